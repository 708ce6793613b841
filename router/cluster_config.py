"""How the pools are built: the model and engine every worker runs, the pools' sizes, where Ray
places their workers, where their KV transfer listens, and the time limits of their lifecycle."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace

from engine.config import EngineConfig
from kv_transfer.faults import FaultPlan
from router.option_values import (
    HANG_MIN_S,
    KV_BACKENDS,
    KV_FAILURE_POLICIES,
    Parse,
    choice,
    integer,
    number,
    off_or,
    resources,
)
from router.workers import Placement
from worker_protocol.messages import WorkerRole, WorkerSpec


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """The pools' own configuration (router/pools.py), made by ClusterConfig.pool_config."""

    spec: WorkerSpec
    placement: dict[WorkerRole, Placement] = field(default_factory=dict)
    start_timeout_s: float = 300.0  # an actor placed, its engine up and warm
    control_timeout_s: float = 30.0  # a control call to a worker
    pair_timeout_s: float = 10.0  # one pairing attempt
    replace_dead: bool = True
    restart_backoff_s: float = 2.0  # after a replacement that failed to start; doubles to 60 s
    drain_timeout_s: float = 30.0  # a removed worker's own requests, before it is stopped
    max_workers: int = 64  # of all pools together, after a resize (ClusterConfig.max_workers)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    model: str = "smollm2-135m"
    num_prefill: int = 1
    num_decode: int = 1
    num_both: int = 0  # workers that prefill for a peer and decode, request by request
    engine: EngineConfig = field(default_factory=EngineConfig)  # its model name is replaced
    threads_per_worker: int = 1
    kv_transfer_deadline_s: float = 30.0
    prefill_timeout_s: float = 600.0  # a prefill's queue wait and compute on its worker
    address: str | None = None  # see router/ray_runtime.py
    # GPUs per worker actor; None: 1 where CUDA is present, else 0. Fractions share a device.
    gpus_per_worker: float | None = None
    # Ray resources each worker of a pool asks for, e.g. {"prefill_node": 1}.
    prefill_resources: dict[str, float] = field(default_factory=dict)
    decode_resources: dict[str, float] = field(default_factory=dict)
    both_resources: dict[str, float] = field(default_factory=dict)
    kv_backend: str = "auto"  # see WorkerSpec.kv_backend
    kv_interface: str | None = None  # see WorkerSpec.kv_interface
    kv_host: str | None = None  # see WorkerSpec.kv_host
    start_timeout_s: float = 300.0
    control_timeout_s: float = 30.0  # a control call to a worker (reserve, abort, load)
    # A worker that answers no load poll for this long is stopped and replaced (0: never).
    worker_hang_timeout_s: float = 60.0
    pair_timeout_s: float = 10.0  # one attempt to pair a prefill and a decode worker
    replace_dead: bool = True  # start a new worker in place of one found dead
    drain_timeout_s: float = 30.0  # a removed worker's own requests, before it is stopped
    # The most workers of all pools together, at start and after a resize: a typo in a
    # resize (100000) must not start actors until the host runs out of memory.
    max_workers: int = 64
    # What a disaggregated request whose KV does not come gets: "recompute" (its decode worker
    # prefills it) or "fail" (UNAVAILABLE with the reason). Counted as a fallback either way.
    kv_failure_policy: str = "recompute"
    kv_faults: FaultPlan | None = None  # faults every worker's KV sends suffer: tests only

    def __post_init__(self) -> None:
        self._check_fields()
        if self.num_decode + self.num_both < 1:
            raise ValueError("need at least one worker that decodes (num_decode + num_both >= 1)")
        total = self.num_prefill + self.num_decode + self.num_both
        if total > self.max_workers:
            raise ValueError(
                f"{total} workers: at most {self.max_workers} in all pools (--max-workers)"
            )
        if self.kv_failure_policy not in KV_FAILURE_POLICIES:
            raise ValueError(
                f"kv_failure_policy: must be one of {', '.join(KV_FAILURE_POLICIES)}, "
                f"got {self.kv_failure_policy!r}"
            )

    def _check_fields(self) -> None:
        """Each field's own range, by the rules of `pdserve serve`'s options (their checks,
        router/option_values.py), on Python values: a string is not a number here."""
        ints = {"num_prefill": 0, "num_decode": 0, "num_both": 0, "threads_per_worker": 1,
                "max_workers": 1}  # fmt: skip
        for name, low in ints.items():
            _check(self, name, (numbers.Integral,), integer(low))
        positive = number(0, strict=True)  # 0 s: every such wait would end at once
        for name in ("kv_transfer_deadline_s", "prefill_timeout_s", "start_timeout_s",
                     "control_timeout_s", "pair_timeout_s"):  # fmt: skip
            _check(self, name, (numbers.Real,), positive)
        _check(self, "drain_timeout_s", (numbers.Real,), number(0))  # 0: no wait for requests
        _check(self, "worker_hang_timeout_s", (numbers.Real,), off_or(number(HANG_MIN_S)))
        if self.gpus_per_worker is not None:
            _check(self, "gpus_per_worker", (numbers.Real,), number(0))
            if self.gpus_per_worker > 1 and self.gpus_per_worker != int(self.gpus_per_worker):
                raise ValueError(
                    "gpus_per_worker: Ray shares a GPU in fractions below 1; above 1 it must be "
                    f"a whole number, got {self.gpus_per_worker:g}"
                )
        for name in ("prefill_resources", "decode_resources", "both_resources"):
            _check(self, name, (dict,), resources)
        _check(self, "kv_backend", (str,), choice(*KV_BACKENDS))

    def pool_config(self, cluster_gpus: float = 0.0) -> PoolConfig:
        """The pools' configuration on a Ray cluster with `cluster_gpus` GPUs in all."""
        gpus = self.gpus_per_worker
        if gpus is None:  # the cluster's, not this machine's: the router may run on a CPU node
            gpus = 1 if cluster_gpus > 0 else 0
        engine = replace(self.engine, model=replace(self.engine.model, model=self.model))
        if 0 < gpus < 1:  # workers share a GPU: each sizes its KV cache within its share
            engine = replace(engine, cache=replace(engine.cache, gpu_share=gpus))
        spec = WorkerSpec(
            engine=engine,
            num_threads=self.threads_per_worker,
            kv_transfer_deadline_s=self.kv_transfer_deadline_s,
            prefill_timeout_s=self.prefill_timeout_s,
            kv_backend=self.kv_backend,
            kv_interface=self.kv_interface,
            kv_host=self.kv_host,
            pair_timeout_s=self.pair_timeout_s,
            kv_faults=self.kv_faults,
        )
        return PoolConfig(
            spec=spec,
            placement={
                WorkerRole.PREFILL: Placement(gpus, tuple(sorted(self.prefill_resources.items()))),
                WorkerRole.DECODE: Placement(gpus, tuple(sorted(self.decode_resources.items()))),
                WorkerRole.BOTH: Placement(gpus, tuple(sorted(self.both_resources.items()))),
            },
            start_timeout_s=self.start_timeout_s,
            control_timeout_s=self.control_timeout_s,
            pair_timeout_s=self.pair_timeout_s,
            replace_dead=self.replace_dead,
            drain_timeout_s=self.drain_timeout_s,
            max_workers=self.max_workers,
        )


def _check(config: ClusterConfig, name: str, types: tuple[type, ...], parse: Parse) -> None:
    """ValueError naming the field where its value is not of `types` or `parse` refuses it. A
    number of another kind (numpy's int64, float32) is taken as Python's int or float."""
    value = getattr(config, name)
    if isinstance(value, numbers.Real) and type(value) not in (int, float, bool):
        if isinstance(value, types):
            value = int(value) if isinstance(value, numbers.Integral) else float(value)
            object.__setattr__(config, name, value)  # frozen: set once, while being built
    try:
        if isinstance(value, bool) or not isinstance(value, types):
            parse(None)  # refused: its message says what was expected
        parse(value)
    except ValueError as exc:
        what = str(exc).replace("got None", f"got {value!r}")
        raise ValueError(f"{name}: {what}") from None
