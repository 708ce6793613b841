"""How much workers on one node slow each other's steps.

Workers on one node share more than their own devices: the node's cores and memory bandwidth
where they run on CPUs, its host threads and PCIe where they drive GPUs. A worker's steps then
run slower while a peer on its node is busy, and a choice that sets an idle worker decoding slows
the requests already decoding beside it (router/interference.py shared_misses).

How much depends on what the peer runs: decodes read every weight each step, and two workers
decoding on one CPU node contend for its memory bandwidth more than a decode beside a peer's
prefill does (measured on a 2-core node: gaps 1.25-1.4x longer with the peer decoding, 1.1-1.2x
with it prefilling). The share is measured for each kind of peer work (`PeerWork`); a worker's
steps carry the larger share of what its peers run.

`HostShare` measures it per node from the steps the workers report: each worker's step-time
model predicts its steps as they would run alone (router/cost_model.py StepTimeModel: fitted on
steps with the share divided out), and the share is how much further the measured steps run over
those predictions while a peer is busy than while none is. Each worker is compared with itself
(its busy steps against its own steps alone: the offsets of different workers' models cancel),
and only workers that have run both ways count: a dedicated prefill worker whose every prefill
has its decode worker waiting tells nothing. Workers on separate GPUs measure about 1, which
reads as 1 (MIN_FACTOR); CPU workers sharing a node's cores measure more.

Until a worker on the node has run both ways, the share is a prior: CPU_PRIOR for a node whose
workers run on CPUs, 1 otherwise; one kind measured leaves the other at its prior. The first
requests decide where decodes gather before any worker has run both ways, and a split broken
then stays broken (both workers decoding, each prefilling beside its own decodes); CPU_PRIOR is
what two one-thread CPU workers measured on a 2-core node, replaced by the node's own figure as
soon as it has one.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Mapping

import numpy as np


class PeerWork(enum.Enum):
    """What a worker's peers on its node run beside its steps (router/pool_state.py
    peer_work: of what they run, the kind with the larger share)."""

    IDLE = "idle"
    PREFILL = "prefill"
    DECODE = "decode"


BUSY = (PeerWork.PREFILL, PeerWork.DECODE)


class HostShare:
    """One node's share per kind of peer work (see the module docstring): its `prior` until a
    worker there has `min_samples` steps beside that kind and alone among its latest `window`
    of each, and within [1, MAX_FACTOR]; under MIN_FACTOR, 1."""

    MIN_FACTOR, MAX_FACTOR = 1.05, 4.0
    CPU_PRIOR = {PeerWork.PREFILL: 1.15, PeerWork.DECODE: 1.3}

    def __init__(
        self,
        window: int = 128,
        min_samples: int = 32,
        prior: Mapping[PeerWork, float] | None = None,
    ) -> None:
        self.window = window
        self.min_samples = min_samples
        self.prior = {k: (prior or {}).get(k, 1.0) for k in BUSY}
        # worker id -> (its incarnation, log(measured / predicted) of its latest steps, by what
        # its peers ran meanwhile)
        self._logs: dict[str, tuple[int, dict[PeerWork, deque[float]]]] = {}
        self._factors: dict[PeerWork, float] = {}

    def observe(
        self,
        worker_id: str,
        incarnation: int,
        predicted_s: float,
        measured_s: float,
        peer: PeerWork,
    ) -> None:
        """A step of `worker_id` that ran in `measured_s`, predicted alone at `predicted_s`,
        beside `peer` work on the node. A new incarnation starts afresh (its model too)."""
        if predicted_s <= 0 or measured_s <= 0:
            return
        logs = self._logs.get(worker_id)
        if logs is None or logs[0] != incarnation:
            logs = self._logs[worker_id] = (
                incarnation,
                {k: deque(maxlen=self.window) for k in PeerWork},
            )
        logs[1][peer].append(math.log(measured_s / predicted_s))
        self._factors.clear()

    def factor(self, peer: PeerWork) -> float:
        """How many times slower steps run beside `peer` work than alone: over the workers that
        ran both ways, the mean of each one's median log-ratio beside it less its median alone
        one, weighted by the fewer of its two counts."""
        if peer is PeerWork.IDLE:
            return 1.0
        f = self._factors.get(peer)
        if f is None:
            diffs, weights = [], []
            for _, logs in self._logs.values():
                alone, shared = logs[PeerWork.IDLE], logs[peer]
                n = min(len(alone), len(shared))
                if n >= self.min_samples:
                    diffs.append(float(np.median(shared)) - float(np.median(alone)))
                    weights.append(n)
            f = math.exp(float(np.average(diffs, weights=weights))) if diffs else self.prior[peer]
            f = self._factors[peer] = 1.0 if f < self.MIN_FACTOR else min(self.MAX_FACTOR, f)
        return f

    @classmethod
    def for_device(cls, device: str) -> HostShare:
        """A node's share, its prior from the type of device its workers run on."""
        return cls(prior=cls.CPU_PRIOR if device == "cpu" else None)
