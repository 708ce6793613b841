"""Every option of `pdserve serve`, defined once: each is a command-line flag and a key of the
YAML file `--config FILE` reads. A key is the flag's name without its dashes, with `_` for `-`
(`--prefill-resources` is `prefill_resources`; `prefill-resources` is accepted too).

Precedence: the defaults below, then the file, then the flags given on the command line. A value
is checked the same way wherever it comes from; a bad one stops the server before it starts,
naming the field (`config FILE: decode: must be an integer >= 1, got 0`).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import yaml

from engine.dtype_names import DTYPE_ALIASES, DTYPE_CHOICES
from router.option_values import (
    HANG_MIN_S,
    KV_BACKENDS,
    KV_FAILURE_POLICIES,
    Option,
    OptionError,
    auto_or,
    choice,
    flag,
    integer,
    number,
    off_or,
    optional,
    path,
    resources,
    text,
)

if TYPE_CHECKING:
    from router.server import ServeConfig

PORT = integer(0, 65535)
OFF_OR_PORT = integer(-1, 65535)
POLICIES = ("auto", "colocated", "disaggregated", "threshold")
# `--prefill-hold-ms auto`: a prompt may wait for decodes up to this share of its TTFT SLO,
# the rest left for its queue and its prefill once they end.
HOLD_SHARE = 0.5
DTYPE_CHOICE = choice(*DTYPE_CHOICES, fold_case=True, aliases=DTYPE_ALIASES)
DTYPE_HELP = (
    "of the weights, activations and KV cache; auto: the checkpoint's own dtype on CUDA "
    "(config.json's dtype, or the GGUF file's; bfloat16 for a quantized GGUF), float32 on CPU"
)
EAGER_HELP = "no CUDA graphs: every decode step runs eagerly (CPU runs always do)"
LOG_LEVELS = ("debug", "info", "warning", "error")

OPTIONS: tuple[Option, ...] = (
    # model and pools
    Option("model", text, "smollm2-135m", "built-in name, HF folder or .gguf"),
    Option("dtype", DTYPE_CHOICE, "auto",
           DTYPE_HELP + " (each worker resolves auto on its own device)"),
    Option("enforce_eager", flag, False, EAGER_HELP, boolean=True),
    Option("prefill", integer(0), 1, "prefill workers (0: colocated only)"),
    Option("decode", integer(0), 1,
           "decode workers (0 with --workers: every decode on a worker that does both)"),
    Option("workers", integer(0), 0,
           "workers that do both, request by request: prefill for a peer (streaming the KV "
           "out) or decode (receiving it, or prefilling locally); beside the dedicated pools"),
    Option("threads", integer(1), 1, "torch threads per worker"),
    Option("seed", optional(integer(0, 2**64 - 1)), None,
           "seed of the requests that give none (default: drawn anew each run); each worker "
           "draws from a stream of its own made from it, so a run repeats its samples where "
           "its requests come in the same order to the same workers"),
    Option("kv_cache_gib", optional(number(0, strict=True)), None,
           "KV cache per CPU worker, GiB (default: 2; a GPU worker's takes 0.8 of the memory "
           "its device has free once the model is loaded)"),
    # placement on a Ray cluster
    Option("ray_address", optional(text), None,
           "HOST:PORT joins that Ray cluster, auto the one this machine is part of, local "
           "starts a private one (default: RAY_ADDRESS, else a runtime already running here, "
           "else local)"),
    Option("prefill_resources", resources, {},
           "Ray resources each prefill worker asks for, as JSON, e.g. '{\"prefill_node\": 1}'"),
    Option("decode_resources", resources, {}, "Ray resources each decode worker asks for"),
    Option("workers_resources", resources, {},
           "Ray resources each worker of --workers asks for"),
    Option("gpus_per_worker", optional(number(0)), None,
           "GPUs per worker (default: 1 where CUDA is present, else 0; fractions share one)"),
    Option("kv_interface", optional(text), None,
           "network interface the KV transfer listens on (default: the address Ray knows the "
           "worker's node by)"),
    Option("kv_host", optional(text), None, "address the KV transfer listens on (overrides "
           "--kv-interface; the same for every worker: for one-node setups)"),
    Option("kv_backend", choice(*KV_BACKENDS, fold_case=True), "auto",
           "KV transfer backend: auto (per pair: nccl between two GPUs, gloo where both ends "
           "share a GPU or one is on CPU), or gloo or nccl for every pair (gloo for MIG slices "
           "of one GPU, which auto takes for two)"),
    Option("pair_timeout", number(0, strict=True), 10.0,
           "seconds one pairing of a prefill and a decode worker may take"),
    Option("start_timeout", number(0, strict=True), 300.0,
           "seconds a worker may take to be placed, load its model and warm up"),
    Option("kv_transfer_deadline", number(0, strict=True), 30.0,
           "seconds a KV send may take from its first layer before the decode worker "
           "gives up on it (and recomputes, or fails it under --kv-failure-policy fail)"),
    Option("kv_failure_policy", choice(*KV_FAILURE_POLICIES, fold_case=True), "recompute",
           "a disaggregated request whose KV does not come: its decode worker prefills it "
           "(recompute), or it ends with UNAVAILABLE and the reason (fail)"),
    Option("replace_dead_workers", flag, True,
           "start a new worker in place of one found dead", boolean=True),
    Option("max_workers", integer(1), 64,
           "the most workers of all pools together, at start and after `pdserve scale`"),
    Option("worker_hang_timeout", off_or(number(HANG_MIN_S)), 60.0,
           "seconds a worker may answer no load poll (it answers between engine steps: keep "
           "this well above the longest step) before it is taken for hung (its engine stuck, its "
           "process stopped, its node unreachable): it is stopped and replaced, and its "
           "requests resume elsewhere; 0: never"),
    # scheduler budgets
    Option("max_num_batched_tokens", integer(1), 512, "tokens per engine step"),
    Option("max_num_seqs", integer(1), 64, "requests in one worker's running batch"),
    Option("chunked_prefill", flag, True,
           "split long prompts into chunks under the token budget (--no-chunked-prefill: a "
           "prompt runs whole in one step, the interference baseline)", boolean=True),
    Option("step_target_ms", optional(auto_or(number(0, strict=True))), None,
           "while requests decode, size prefill chunks so a step takes about this long "
           "(chunked prefill only; default: the token budget alone); auto: start at 0.8 x "
           "the ITL SLO and tune each worker's from the ITL p99 its requests see"),
    Option("prefill_hold_ms", optional(auto_or(number(0))), None,
           "with --step-target-ms: where even the smallest chunk beside running decodes takes "
           "a step past the target (as on a CPU host), prompts wait for decodes that will end "
           "(at their max_tokens) within this long, in all per prompt, instead of slowing "
           f"their steps; auto: {HOLD_SHARE:g} x each request's TTFT SLO; default (or 0): "
           "prompts never wait"),
    # policy and SLOs
    Option("policy", choice(*POLICIES, fold_case=True), "auto",
           "how each request's path is chosen (auto: the cost model)"),
    Option("threshold_tokens", integer(0), 256,
           "threshold policy: prompts with more uncached tokens go disaggregated"),
    Option("threshold_queue", integer(0), 4,
           "threshold policy: ...while the prefill queue holds fewer requests"),
    Option("slo_ttft_ms", number(0, strict=True), 60000.0, "default TTFT SLO"),
    Option("slo_itl_ms", number(0, strict=True), 1000.0, "default ITL SLO"),
    Option("max_pending", integer(1), 256,
           "requests waiting for a first token before RESOURCE_EXHAUSTED"),
    Option("decode_rate_admission", flag, True,
           "refuse a request (RESOURCE_EXHAUSTED, decode_rate) while requests come faster "
           "than the decodes hold its ITL SLO in steady state, as the step-time model "
           "predicts, so that those taken attain it rather than all missing", boolean=True),
    # addresses and ports
    Option("host", text, "127.0.0.1", "address the gRPC, HTTP and metrics ports bind"),
    Option("port", PORT, 50051, "gRPC port (pdserve.v1.Generation)"),
    Option("http_port", OFF_OR_PORT, -1,
           "OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) on --host; "
           "-1: off"),
    Option("metrics_port", OFF_OR_PORT, 9400, "Prometheus /metrics on --host; -1: off"),
    Option("admin_port", OFF_OR_PORT, 50052,
           "pdserve.v1.Admin (scale, list workers) on --admin-host, for operators only; -1: off"),
    Option("admin_host", text, "127.0.0.1",
           "address the admin port binds: this machine only unless set (an operator reaches it "
           "from a shell here or through a port-forward)"),
    # security
    Option("tls_cert", optional(path), None, "server certificate chain (PEM): serve over TLS",
           is_path=True),
    Option("tls_key", optional(path), None, "the server certificate's private key (PEM)",
           is_path=True),
    Option("tls_client_ca", optional(path), None,
           "CA certificate (PEM): clients must present a certificate it signed (mutual TLS)",
           is_path=True),
    Option("auth_token_file", optional(path), None,
           "file holding the bearer token every request but the health checks must carry",
           is_path=True),
    Option("max_streams_per_client", optional(integer(1)), None,
           "concurrent requests one client address may have (default: no limit)"),
    Option("max_tokens_limit", optional(integer(1)), None,
           "the largest max_tokens a request may ask for (default: the model's context)"),
    Option("drain_timeout", number(0), 30.0,
           "seconds in-flight requests get on SIGINT/SIGTERM, and a removed worker on a resize"),
    Option("log_level", choice(*LOG_LEVELS, fold_case=True), "info",
           "the server's log: info has a line per request placed (its path and why), warning "
           "keeps what went wrong and the refusals"),
)  # fmt: skip
BY_NAME = {o.name: o for o in OPTIONS}


def add_flags(p: argparse.ArgumentParser) -> None:
    """Every option as a flag. Defaults are left out (SUPPRESS), so that only the flags given
    appear in the namespace and can override the file."""
    p.add_argument("--config", type=Path, default=None, help="YAML file of these options")
    p.add_argument(
        "--print-config", action="store_true", help="print the effective options as YAML and exit"
    )
    for o in OPTIONS:
        default = o.default if o.default not in (None, {}) else None
        note = f" (default: {json.dumps(default)})" if default is not None else ""
        if isinstance(o.parse, choice):
            note = f" ({o.parse.describe()}{note.replace(' (', '; ')[:-1]})"
        if o.boolean:
            p.add_argument(
                o.flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                help=o.help + note,
            )  # fmt: skip
        else:
            p.add_argument(o.flag, type=flag_type(o), default=argparse.SUPPRESS, help=o.help + note)


def flag_type(o: Option) -> Callable[[str], Any]:
    """An argparse type checking a flag's value as the option's own check does."""

    def convert(s: str) -> Any:
        try:
            return o.parse(s)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = o.name  # argparse names the type in some errors
    return convert


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (which YAML would take as
    its last value, the first one lost silently), an option's `-` and `_` spellings alike; and
    reading numbers as YAML 1.2 does: `050051` is 50051 (YAML 1.1 reads a leading 0 as octal,
    20521), `1:30` and `1:30.5` are strings (1.1: 90 and 90.5, in base 60), `1e3` is 1000.0."""

    _root: Any = None

    def construct_document(self, node: Any) -> Any:
        self._root = node
        return super().construct_document(node)

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` merges a mapping in: not a field of its own
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # not an option name: refused as an unknown field later
            # Option names are spelled either way; other keys (Ray resources) are as written.
            name = key.replace("-", "_") if isinstance(key, str) and node is self._root else key
            if name in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"field {key!r} is given twice", key_node.start_mark
                )
            seen.add(name)
        return super().construct_mapping(node, deep)


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_UniqueKeys.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# YAML 1.2's core schema: an integer first, then a float (1e3 included; 1:30.5 no longer 90.5).
_UniqueKeys.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_UniqueKeys.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)


def _yaml12_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    word = str(loader.construct_scalar(node))
    if word.startswith(("0o", "0x")):
        return int(word[2:], 8 if word[1] == "o" else 16)
    return int(word)


_UniqueKeys.add_constructor(_INT, _yaml12_int)


def read_file(path: Path) -> dict[str, Any]:
    """The options a YAML file sets, checked; raises OptionError naming the field."""
    where = f"config {path}"
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeys)
    except OSError as exc:
        raise OptionError(f"{where}: cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise OptionError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise OptionError(f"{where}: not valid YAML: {exc}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise OptionError(f"{where}: must be a mapping of option names to values")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        option = BY_NAME.get(name)
        if option is None:
            near = difflib.get_close_matches(name, BY_NAME, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise OptionError(f"{where}: unknown field {key!r}{hint}")
        try:
            out[name] = option.parse(value)
        except ValueError as exc:
            raise OptionError(f"{where}: {name}: {exc}") from None
        if option.is_path and out[name] is not None and not out[name].is_absolute():
            out[name] = path.absolute().parent / out[name]  # wherever serve runs
    return out


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """Every option's effective value (defaults, then the file, then the flags)."""

    values: Mapping[str, Any]

    def to_yaml(self) -> str:
        """A complete config file: every option, in the order of OPTIONS.

        `dtype: auto` is printed as such, with a comment: the router cannot know what it
        becomes, since each worker resolves it on its own device."""
        plain = {o.name: self.values[o.name] for o in OPTIONS}
        plain = {k: str(v) if isinstance(v, Path) else v for k, v in plain.items()}
        text = yaml.safe_dump(plain, sort_keys=False)
        if plain["ray_address"] is None and os.environ.get("RAY_ADDRESS"):
            text += f"# ray_address null: RAY_ADDRESS={os.environ['RAY_ADDRESS']} is joined\n"
        if plain["dtype"] == "auto":
            text += (
                "# dtype auto: each worker resolves it on its own device: the checkpoint's own "
                "dtype on CUDA, float32 on CPU\n"
            )
        return text

    def serve_config(self) -> ServeConfig:
        """The server's configuration."""
        # Imported here: building the parser (every `pdserve` command) must not load Ray.
        from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
        from router.cluster_config import ClusterConfig
        from router.core_types import RouterConfig
        from router.policy import Policy, PolicyConfig
        from router.security import SecurityConfig
        from router.server import ServeConfig

        v = self.values
        cache = CacheConfig()
        if v["kv_cache_gib"] is not None:
            cache = replace(cache, cpu_kv_cache_gib=v["kv_cache_gib"])
        step_target, hold = v["step_target_ms"], v["prefill_hold_ms"]
        tune, hold_share = step_target == "auto", None
        if hold == "auto":  # per request, from its TTFT SLO; this default for one without
            hold_share, hold = HOLD_SHARE, HOLD_SHARE * v["slo_ttft_ms"]
        if tune:
            step_target = 0.8 * v["slo_itl_ms"]  # a first guess, tuned from the measured ITL
        engine = EngineConfig(
            # the cluster sets its model name
            model=ModelConfig(
                dtype=v["dtype"], enforce_eager=v["enforce_eager"], sampling_seed=v["seed"]
            ),
            cache=cache,
            scheduler=SchedulerConfig(
                max_num_batched_tokens=v["max_num_batched_tokens"],
                max_num_seqs=v["max_num_seqs"],
                enable_chunked_prefill=v["chunked_prefill"],
                step_target_s=None if step_target is None else step_target / 1000,
                prefill_hold_s=None if hold is None else hold / 1000,
            ),
        )
        cluster = ClusterConfig(
            model=v["model"],
            num_prefill=v["prefill"],
            num_decode=v["decode"],
            num_both=v["workers"],
            engine=engine,
            threads_per_worker=v["threads"],
            address=v["ray_address"],
            gpus_per_worker=v["gpus_per_worker"],
            prefill_resources=v["prefill_resources"],
            decode_resources=v["decode_resources"],
            both_resources=v["workers_resources"],
            kv_interface=v["kv_interface"],
            kv_host=v["kv_host"],
            kv_backend=v["kv_backend"],
            pair_timeout_s=v["pair_timeout"],
            start_timeout_s=v["start_timeout"],
            replace_dead=v["replace_dead_workers"],
            worker_hang_timeout_s=v["worker_hang_timeout"],
            max_workers=v["max_workers"],
            kv_failure_policy=v["kv_failure_policy"],
            kv_transfer_deadline_s=v["kv_transfer_deadline"],
            drain_timeout_s=v["drain_timeout"],
        )
        policy = PolicyConfig(
            policy=Policy(v["policy"]),
            threshold_tokens=v["threshold_tokens"],
            threshold_queue=v["threshold_queue"],
        )
        return ServeConfig(
            cluster=cluster,
            router=RouterConfig(
                policy=policy,
                slo_ttft_s=v["slo_ttft_ms"] / 1000,
                slo_itl_s=v["slo_itl_ms"] / 1000,
                max_pending=v["max_pending"],
                decode_rate_admission=v["decode_rate_admission"],
                tune_step_target=tune,
                prefill_hold_share=hold_share,
            ),
            host=v["host"],
            port=v["port"],
            metrics_port=None if v["metrics_port"] < 0 else v["metrics_port"],
            admin_port=None if v["admin_port"] < 0 else v["admin_port"],
            admin_host=v["admin_host"],
            http_port=None if v["http_port"] < 0 else v["http_port"],
            drain_timeout_s=v["drain_timeout"],
            security=SecurityConfig(
                tls_cert=v["tls_cert"],
                tls_key=v["tls_key"],
                tls_client_ca=v["tls_client_ca"],
                auth_token_file=v["auth_token_file"],
            ),
            max_streams_per_client=v["max_streams_per_client"],
            max_tokens_limit=v["max_tokens_limit"],
        )


def resolve(args: argparse.Namespace) -> ServeOptions:
    """Defaults, then the file, then the flags given: every option's effective value."""
    values = {o.name: o.default for o in OPTIONS}
    if args.config is not None:
        values.update(read_file(args.config))
    values.update({o.name: getattr(args, o.name) for o in OPTIONS if hasattr(args, o.name)})
    if values["decode"] + values["workers"] < 1:
        raise OptionError(
            "decode (--decode): need at least 1 worker that decodes: a decode worker, or one "
            "of --workers"
        )
    if values["max_num_seqs"] > values["max_num_batched_tokens"]:
        raise OptionError(
            f"max_num_batched_tokens (--max-num-batched-tokens): must be >= max_num_seqs "
            f"(--max-num-seqs, {values['max_num_seqs']}): every step's decodes must fit its "
            f"budget, got {values['max_num_batched_tokens']}"
        )
    if values["step_target_ms"] is not None and not values["chunked_prefill"]:
        raise OptionError(
            "step_target_ms (--step-target-ms): sizes prefill chunks, so it needs chunked_prefill"
        )
    if values["prefill_hold_ms"] == 0:  # as its default: prompts never wait
        values["prefill_hold_ms"] = None
    if values["prefill_hold_ms"] is not None and values["step_target_ms"] is None:
        raise OptionError(
            "prefill_hold_ms (--prefill-hold-ms): prompts wait where a chunk cannot keep to the "
            "step target, so it needs step_target_ms"
        )
    gpus = values["gpus_per_worker"]
    if gpus is not None and gpus > 1 and gpus != int(gpus):
        raise OptionError(
            f"gpus_per_worker (--gpus-per-worker): Ray shares a GPU in fractions below 1; above "
            f"1 it must be a whole number, got {gpus:g}"
        )
    _check_ports(values)
    return ServeOptions(MappingProxyType(values))


def _check_ports(values: Mapping[str, Any]) -> None:
    """The ports the server listens on (0: any free one, -1: off) must differ."""
    taken: dict[int, str] = {}
    for name in ("port", "http_port", "admin_port", "metrics_port"):
        port = values[name]
        if port > 0 and port in taken:
            other = taken[port]
            raise OptionError(
                f"{name} ({_flag(name)}): {port} is {_flag(other)}'s too; each port the server "
                "listens on must differ"
            )
        taken[port] = name


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
