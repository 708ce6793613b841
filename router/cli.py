"""The `pdserve` command line: argument parsing and dispatch to one handler per subcommand.

Handlers import what they run lazily, so `pdserve generate` never pays for the benchmark's imports
(or the engine's, for `--help`). Bad input (a sampling parameter out of range, an unknown model, a
prompt the model can't take) ends with one `error: ...` line on stderr and exit status 2, like
argparse's own usage errors; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
from collections.abc import Callable, Sequence
from typing import Any

# Same status argparse uses for a usage error.
EXIT_USAGE = 2

Handler = Callable[[argparse.Namespace, list[str]], int]


class _Help(argparse.HelpFormatter):
    """argparse's help, each option's default said where it has one and its help does not say
    it already (argparse.ArgumentDefaultsHelpFormatter would also print "default: None")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default in (None, False, argparse.SUPPRESS)
            or default == []
            or not action.option_strings
            or isinstance(action, argparse._HelpAction)
        ):
            return action.help
        return f"{text} (default: %(default)s)".lstrip()


def _parser(sub: argparse._SubParsersAction, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    # No abbreviations: `--max-num-seq` must not become --max-num-seqs today and an error (or
    # another option) once a flag sharing the prefix is added; the config file takes whole names.
    return sub.add_parser(name, formatter_class=_Help, allow_abbrev=False, **kwargs)


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
    from router.client import add_sampling_arguments
    from router.serve_options import BY_NAME, DTYPE_CHOICE, DTYPE_HELP, EAGER_HELP, flag_type

    p = _parser(sub, "generate", help="complete prompts offline with one in-process engine")
    p.add_argument("--model", default="smollm2-135m", help="built-in name, HF folder or .gguf")
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap each prompt in the model's chat template (default: on when the model has one)",
    )
    p.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=None,
        help="tokens to generate at most (default: 256, or what the context leaves of it)",
    )
    add_sampling_arguments(p)
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per prompt: text, token ids, finish and usage (and logprobs)",
    )
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    p.add_argument(
        "--dtype", type=flag_type(BY_NAME["dtype"]), default="auto",
        help=f"{DTYPE_HELP} ({DTYPE_CHOICE.describe()})",
    )  # fmt: skip
    p.add_argument("--enforce-eager", action="store_true", help=EAGER_HELP)
    p.add_argument("prompt", nargs="+")
    p.set_defaults(handler=_generate, passthrough=False)


def _generate(args: argparse.Namespace, _extra: list[str]) -> int:
    from router import generate_cli

    return generate_cli.run(args, _error)


def _add_bench_engine(sub: argparse._SubParsersAction) -> None:
    # The benchmark's own arguments are defined by engine.bench_engine, which is imported only when
    # this subcommand runs; everything after the subcommand name is handed to its parser.
    p = _parser(
        sub,
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
    parser = argparse.ArgumentParser(
        prog="pdserve bench-engine", formatter_class=_Help, allow_abbrev=False
    )
    bench_engine.add_arguments(parser)
    args = parser.parse_args(extra)
    try:
        prepared = bench_engine.prepare(args)
    except ValueError as exc:  # bad input (the flag named), an unknown model
        return _error(exc)
    return int(bench_engine.run(args, prepared))


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from router import serve_options

    p = _parser(
        sub,
        "serve",
        help="start the gRPC server with prefill and decode pools",
        description="Every option is also a key of the --config YAML file; flags override it.",
    )
    serve_options.add_flags(p)
    p.set_defaults(handler=_serve, passthrough=False)


def _serve(args: argparse.Namespace, _extra: list[str]) -> int:
    import logging

    from router import effective_options

    try:
        options = effective_options.resolve(args)
        config = options.serve_config()  # the engine's and the cluster's own checks
        config.security.check()
        # Ports in use (a server running) are the moment, not the config: printed all the same.
        config.check_hosts(ports_free=not args.print_config)
    except ValueError as exc:  # OptionError and SecurityError included
        return _error(exc)
    if args.print_config:  # a config that serve would take, nothing less: the model too
        from engine.errors import ModelNotFoundError
        from router.serve_config import model_tokenizer

        try:
            model_tokenizer(config)
        except (ModelNotFoundError, OSError) as exc:  # OSError: a GGUF's cache not writable
            return _error(exc)
        print(options.to_yaml(), end="")
        return 0
    level = options.values["log_level"].upper()
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(message)s")

    import asyncio

    from engine.errors import ModelNotFoundError
    from router.pools import PoolsUnavailable
    from router.ray_runtime import RayUnavailable
    from router.serve_signals import serve

    try:
        asyncio.run(serve(config))
    except (ModelNotFoundError, OSError, RayUnavailable, PoolsUnavailable) as exc:
        return _error(exc)
    finally:
        import ray  # imported with router.pools above

        # Here rather than at exit, where Ray's own hook first waits half a second for its
        # workers' log lines to print (none come: serve does not take them).
        ray.shutdown()
    return 0


def _add_complete(sub: argparse._SubParsersAction) -> None:
    from router import client

    p = _parser(sub, "complete", help="send one completion request to a running server")
    client.add_arguments(p)
    p.set_defaults(handler=_complete, passthrough=False)


def _complete(args: argparse.Namespace, _extra: list[str]) -> int:
    from router import client

    return client.run(args)


def _add_scale(sub: argparse._SubParsersAction) -> None:
    from router import admin_client

    p = _parser(sub, "scale", help="resize a running server's pools (its admin port)")
    admin_client.add_scale_arguments(p)
    p.set_defaults(handler=lambda a, _e: admin_client.run_scale(a), passthrough=False)
    p = _parser(sub, "workers", help="list a running server's workers (its admin port)")
    admin_client.add_workers_arguments(p)
    p.set_defaults(handler=lambda a, _e: admin_client.run_workers(a), passthrough=False)


def _add_status(sub: argparse._SubParsersAction) -> None:
    from router import status

    p = _parser(sub, "status", help="summarize a running server from its metrics endpoint")
    status.add_arguments(p)
    p.set_defaults(handler=_status, passthrough=False)


def _status(args: argparse.Namespace, _extra: list[str]) -> int:
    from router import status

    return status.run(args)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = _parser(
        sub,
        "bench",
        help="SLO goodput benchmark: a trace through each policy (see `pdserve bench -h`)",
        add_help=False,
    )
    p.set_defaults(handler=_bench, passthrough=True)


def _bench(_args: argparse.Namespace, extra: list[str]) -> int:
    from bench import cli as bench_cli

    return int(bench_cli.main(bench_parser().parse_args(extra)))


def bench_parser() -> argparse.ArgumentParser:
    from bench import cli as bench_cli

    parser = argparse.ArgumentParser(
        prog="pdserve bench",
        description=bench_cli.__doc__,
        formatter_class=_Help,
        allow_abbrev=False,
    )
    bench_cli.add_arguments(parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Serve LLM completions without prefill/decode interference (README.md).",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_serve(sub)
    _add_complete(sub)
    _add_scale(sub)
    _add_status(sub)
    _add_bench_engine(sub)
    _add_bench(sub)
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["serve"]:  # a client: gRPC's own log lines (a TLS handshake) are noise
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # read as gRPC is first imported
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not args.passthrough:  # the command's usage, not pdserve's
        command = _subcommands(parser)[args.command]
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    handler: Handler = args.handler
    from pdserve_client.connect import ClientAuthError

    try:
        rc = handler(args, extra)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return rc
    except ClientAuthError as exc:  # a client's TLS or token option (workers, scale, bench)
        return _error(exc)
    except KeyboardInterrupt:  # Ctrl-C where a command has no say of its own (generate)
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if _stdout_open():
            raise  # another pipe or socket broke, not the output's
        # Its reader closed the pipe (`| head`): nothing more to say. Python flushes stdout
        # again at exit: point it at nothing first (its docs' advice).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell reports a command SIGPIPE ended


def _stdout_open() -> bool:
    """Whether standard output still takes writes: not a pipe whose reader closed it (poll
    says POLLERR of such a pipe's end)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return not any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (OSError, ValueError):
        return True  # not a file it can poll, or closed by the command itself


if __name__ == "__main__":
    sys.exit(main())
