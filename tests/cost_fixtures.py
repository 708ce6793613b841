"""Workers, requests and planners with injected measurements, for the cost-model tests."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from engine.prefix_hash import block_hashes
from engine.step_stats import StepStat
from router.cost_model import prefill_pairs
from router.fake_backend import fake_info
from router.handoff_model import TransferTimeModel
from router.host_share import HostShare, PeerWork
from router.policy import Planner, Policy, PolicyConfig, RequestShape
from router.pool_state import WorkerState
from router.spread import MISS_WIDTH, PredictionSpread
from worker_protocol.messages import WorkerRole

# The "true" step time of the injected workers: 20 ms + 2 ms/token + attention terms.
TRUE = np.array([0.020, 0.002, 2e-7, 1e-7])
BLOCK = 16


def true_step(tokens: int, pairs: float, ctx: int) -> float:
    return float(TRUE @ np.array([1.0, tokens, pairs, ctx]))


def trained(
    worker_id: str,
    role: str,
    seed: int = 0,
    step_target_s: float | None = None,
    prefill_hold_s: float | None = None,
) -> WorkerState:
    """A worker whose model has seen 300 steps of mixed shapes timed by TRUE (+-2% noise)."""
    info = replace(
        fake_info(worker_id, WorkerRole(role)),
        block_size=BLOCK,
        step_target_s=step_target_s,
        prefill_hold_s=prefill_hold_s,
    )
    state = WorkerState(info)
    # Its predictions have been seen to hold as well as the models claim (router/spread.py).
    state.measured.itl_spread = PredictionSpread(prior=MISS_WIDTH)
    rng = np.random.default_rng(seed)
    for _ in range(300):
        batch = int(rng.integers(0, 32))
        ctx = batch * int(rng.integers(16, 1024))
        chunk = int(rng.choice([0, 0, 16, 128, 512 - batch]))
        cached = int(rng.integers(0, 1024)) if chunk else 0
        pairs = prefill_pairs(chunk, cached)
        if batch + chunk == 0:
            continue
        t = true_step(batch + chunk, pairs, ctx) * (1 + rng.normal(0, 0.02))
        state.model.observe(StepStat(batch + chunk, chunk, pairs, batch, ctx, t))
    return state


def shape(n: int, seed: int = 0, max_tokens: int = 64, slo_ttft=30.0, slo_itl=10.0):
    ids = np.random.default_rng(seed).integers(0, 500, n).tolist()
    return RequestShape(n, tuple(block_hashes(ids, BLOCK)), max_tokens, slo_ttft, slo_itl)


def planner(policy: Policy = Policy.AUTO, **kw) -> Planner:
    transfer = TransferTimeModel()
    for nbytes in (1e5, 1e6, 1e7, 5e7):  # measured: 30 ms latency, 2 GB/s
        for _ in range(5):
            transfer.observe(int(nbytes), 0.030 + nbytes / 2e9)
    pl = Planner(PolicyConfig(policy=policy, **kw), transfer)
    pl.ttft_spread = PredictionSpread(prior=MISS_WIDTH)  # as the workers' (see trained)
    return pl


def with_decodes(
    state: WorkerState, n: int, ctx: int, itl_slo_s: float, left: int = 0
) -> WorkerState:
    for i in range(n):
        state.add_decode(f"running-{i}", ctx, itl_slo_s, local=False, left=left)
    return state


def sharing(factor: float, *workers: WorkerState, prefill: float | None = None) -> HostShare:
    """One node's share, measured at `factor` beside a decoding peer (and at `prefill`, or the
    same, beside a prefilling one) by a worker that ran each way, given to `workers` (on node
    10.0.0.1)."""
    share = HostShare()
    for _ in range(64):
        share.observe("other", 0, 1.0, 1.0, PeerWork.IDLE)
        share.observe("other", 0, 1.0, factor, PeerWork.DECODE)
        share.observe("other", 0, 1.0, prefill or factor, PeerWork.PREFILL)
    for w in workers:
        w.info = replace(w.info, node_ip="10.0.0.1")
        w.host = share
    return share
