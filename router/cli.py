"""The `pdserve` command line: argument parsing and dispatch to one handler per subcommand.

Handlers import what they run lazily, so `pdserve generate` never pays for the benchmark's imports
(or the engine's, for `--help`). Bad input (a sampling parameter out of range, an unknown model, a
prompt the model can't take) ends with one `error: ...` line on stderr and exit status 2, like
argparse's own usage errors; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

# Same status argparse uses for a usage error.
EXIT_USAGE = 2

Handler = Callable[[argparse.Namespace, list[str]], int]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _error(exc: Exception) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return EXIT_USAGE


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete prompts offline with one in-process engine")
    p.add_argument("--model", default="smollm2-135m", help="built-in name, HF folder or .gguf")
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap each prompt in the model's chat template (default: on when the model has one)",
    )
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default here) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    p.add_argument("prompt", nargs="+")
    p.set_defaults(handler=_generate, passthrough=False)


def _generate(args: argparse.Namespace, _extra: list[str]) -> int:
    from transformers.utils.logging import disable_progress_bar

    from engine.config import EngineConfig, ModelConfig
    from engine.errors import InvalidRequestError, ModelNotFoundError
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    # The weight-loading progress bar is noise for a one-shot command.
    disable_progress_bar()
    try:
        # Parameters first: a typo should not wait for the model to load.
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop),
        )
        config = EngineConfig(model=ModelConfig(model=args.model, num_threads=args.threads))
        engine = LLMEngine(config)
    except ValueError as exc:  # InvalidRequestError and ModelNotFoundError included
        return _error(exc)
    try:
        if any(p == "" for p in args.prompt):
            raise InvalidRequestError("prompt", "must not be empty (at least 1 character)")
        chat = args.chat
        if chat is None:
            chat = bool(getattr(engine.tokenizer, "chat_template", None))
        prompts = [engine.encode(p, chat=chat) for p in args.prompt]
        completions = engine.generate(prompts, params)
    except (InvalidRequestError, ModelNotFoundError) as exc:
        return _error(exc)
    if len(completions) == 1:
        print(completions[0].text)
        return 0
    for i, (prompt, c) in enumerate(zip(args.prompt, completions), start=1):
        print(f"=== [{i}] {prompt}")
        print(c.text)
    return 0


def _add_bench_engine(sub: argparse._SubParsersAction) -> None:
    # The benchmark's own arguments are defined by engine.bench_engine, which is imported only when
    # this subcommand runs; everything after the subcommand name is handed to its parser.
    p = sub.add_parser(
        "bench-engine",
        help="benchmark the engine offline (see `pdserve bench-engine -h`)",
        add_help=False,
    )
    p.set_defaults(handler=_bench_engine, passthrough=True)


def _bench_engine(_args: argparse.Namespace, extra: list[str]) -> int:
    try:
        from engine import bench_engine
    except ModuleNotFoundError as exc:
        if exc.name != "engine.bench_engine":
            raise
        return _error(RuntimeError("bench-engine is not available in this installation"))
    parser = argparse.ArgumentParser(prog="pdserve bench-engine")
    bench_engine.add_arguments(parser)
    return int(bench_engine.run(parser.parse_args(extra)))


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the gRPC server with prefill and decode pools")
    p.add_argument("--model", default="smollm2-135m", help="built-in name, HF folder or .gguf")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (0: colocated only)")
    p.add_argument("--decode", type=_positive_int, default=1, help="decode workers")
    p.add_argument(
        "--policy",
        choices=["auto", "colocated", "disaggregated", "threshold"],
        default="auto",
        help="how each request's path is chosen (auto: the cost model)",
    )
    p.add_argument("--threshold-tokens", type=int, default=256, help="threshold policy: T")
    p.add_argument("--threshold-queue", type=int, default=4, help="threshold policy: Q")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument(
        "--metrics-port", type=int, default=9400, help="Prometheus /metrics on --host; -1: off"
    )
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: local)")
    p.add_argument("--threads", type=_positive_int, default=1, help="torch threads per worker")
    p.add_argument("--slo-ttft-ms", type=float, default=60000.0, help="default TTFT SLO")
    p.add_argument("--slo-itl-ms", type=float, default=1000.0, help="default ITL SLO")
    p.add_argument(
        "--max-pending",
        type=_positive_int,
        default=256,
        help="requests waiting for a first token before RESOURCE_EXHAUSTED",
    )
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=512)
    p.add_argument(
        "--chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts into chunks under the token budget (--no-chunked-prefill: a "
        "prompt runs whole in one step, the interference baseline)",
    )
    p.add_argument(
        "--step-target-ms",
        type=_positive_float,
        default=None,
        help="while requests decode, size prefill chunks so a step takes about this long "
        "(chunked prefill only; default: the token budget alone)",
    )
    p.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache per worker (CPU)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds, on SIGINT/SIGTERM")
    p.set_defaults(handler=_serve, passthrough=False)


def _serve(args: argparse.Namespace, _extra: list[str]) -> int:
    import asyncio
    import logging
    from dataclasses import replace

    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.errors import ModelNotFoundError
    from router.cluster import ClusterConfig
    from router.core_types import RouterConfig
    from router.policy import Policy, PolicyConfig
    from router.server import ServeConfig, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        cache = (
            CacheConfig()
            if args.kv_cache_gib is None
            else replace(CacheConfig(), cpu_kv_cache_gib=args.kv_cache_gib)
        )
        engine = EngineConfig(
            cache=cache,
            scheduler=SchedulerConfig(
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_chunked_prefill=args.chunked_prefill,
                step_target_s=None if args.step_target_ms is None else args.step_target_ms / 1000,
            ),
        )
        config = ServeConfig(
            cluster=ClusterConfig(
                model=args.model,
                num_prefill=args.prefill,
                num_decode=args.decode,
                engine=engine,
                threads_per_worker=args.threads,
                address=args.ray_address,
            ),
            router=RouterConfig(
                policy=PolicyConfig(
                    policy=Policy(args.policy),
                    threshold_tokens=args.threshold_tokens,
                    threshold_queue=args.threshold_queue,
                ),
                slo_ttft_s=args.slo_ttft_ms / 1000,
                slo_itl_s=args.slo_itl_ms / 1000,
                max_pending=args.max_pending,
            ),
            host=args.host,
            port=args.port,
            metrics_port=None if args.metrics_port < 0 else args.metrics_port,
            drain_timeout_s=args.drain_timeout,
        )
    except ValueError as exc:
        return _error(exc)
    try:
        asyncio.run(serve(config))
    except (ModelNotFoundError, OSError) as exc:
        return _error(exc)
    return 0


def _add_complete(sub: argparse._SubParsersAction) -> None:
    from router import client

    p = sub.add_parser("complete", help="send one completion request to a running server")
    client.add_arguments(p)
    p.set_defaults(handler=_complete, passthrough=False)


def _complete(args: argparse.Namespace, _extra: list[str]) -> int:
    from router import client

    return client.run(args)


def _add_status(sub: argparse._SubParsersAction) -> None:
    from router import status

    p = sub.add_parser("status", help="summarize a running server from its metrics endpoint")
    status.add_arguments(p)
    p.set_defaults(handler=_status, passthrough=False)


def _status(args: argparse.Namespace, _extra: list[str]) -> int:
    from router import status

    return status.run(args)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="SLO goodput benchmark: a trace through each policy (see `pdserve bench -h`)",
        add_help=False,
    )
    p.set_defaults(handler=_bench, passthrough=True)


def _bench(_args: argparse.Namespace, extra: list[str]) -> int:
    from bench import cli as bench_cli

    parser = argparse.ArgumentParser(prog="pdserve bench", description=bench_cli.__doc__)
    bench_cli.add_arguments(parser)
    return int(bench_cli.run(parser.parse_args(extra)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_serve(sub)
    _add_complete(sub)
    _add_status(sub)
    _add_bench_engine(sub)
    _add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not args.passthrough:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "step_target_ms", None) is not None and not args.chunked_prefill:
        parser.error("--step-target-ms sizes prefill chunks: it needs chunked prefill")
    handler: Handler = args.handler
    return handler(args, extra)


if __name__ == "__main__":
    sys.exit(main())
