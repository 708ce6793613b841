"""Every option of `pdserve serve` at its effective value, and the server's configuration they
make.

Precedence: the defaults (router/serve_options.py), then the file (router/config_file.py), then
the flags given on the command line. A value is checked the same way wherever it comes from; a bad
one, or options that do not go together, stop the server before it starts, naming the field
(`config FILE: decode: must be an integer >= 1, got 0`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import yaml

from router.config_file import model_beside, read_file
from router.option_values import OptionError
from router.serve_options import HOLD_SHARE, OPTIONS

if TYPE_CHECKING:
    from router.serve_config import ServeConfig


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
        # Imported here: resolving the options must not load Ray; only this configuration needs it.
        from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
        from router.cluster_config import ClusterConfig
        from router.core_types import RouterConfig
        from router.policy import Policy, PolicyConfig
        from router.security import SecurityConfig
        from router.serve_config import ServeConfig

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
            served_model_name=v["served_model_name"],
            max_tokens_limit=v["max_tokens_limit"],
        )


def resolve(args: argparse.Namespace) -> ServeOptions:
    """Defaults, then the file, then the flags given: every option's effective value."""
    values = {o.name: o.default for o in OPTIONS}
    if args.config is not None:
        given = read_file(args.config)
        values.update(given)
        if "model" in given and not hasattr(args, "model"):  # the file's, where no flag's
            written = values["model"]
            values["model"] = model_beside(written, args.config)
            if values["model"] != written and values["served_model_name"] is None:
                values["served_model_name"] = written  # served as the file names it
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
