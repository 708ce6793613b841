"""Every option of `pdserve serve`, defined once: each is a command-line flag and a key of the
YAML file `--config FILE` reads (router/config_file.py). A key is the flag's name without its
dashes, with `_` for `-` (`--prefill-resources` is `prefill_resources`; `prefill-resources` is
accepted too). Their effective values, defaults then file then flags: router/effective_options.py.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.dtype_names import DTYPE_ALIASES, DTYPE_CHOICES
from router.option_values import (
    HANG_MIN_S,
    KV_BACKENDS,
    KV_FAILURE_POLICIES,
    Option,
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
    Option("served_model_name", optional(text), None,
           "the model's name in the APIs (the HTTP `model` requests must give, as /v1/models "
           "lists it; gRPC Info's model); default: --model as given"),
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
           "GPUs per worker (default: 1 where CUDA is present, else 0; fractions share one, "
           "each worker's KV cache within its fraction of the GPU's memory)"),
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
