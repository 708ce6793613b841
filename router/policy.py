"""Where a request runs: predictions for every (path, prefill worker, decode worker) and the
policies that choose among them.

  - auto: the cost model. Disaggregated candidates whose pair keeps falling back to a local
    prefill (failure rate over MAX_FAILURE_RATE, router/cost_model.py HandoffHealth) are dropped
    while any other remains, and every disaggregated prediction carries its pair's failure risk.
    Candidates that would push a running request's predicted ITL past its
    SLO are dropped while any other remains (if none remains, the one that pushes least wins);
    a request whose first token came after its TTFT SLO cannot attain and guards nothing;
    of the rest, the one with the least predicted SLO violation wins, then the earliest
    predicted second token (TTFT + ITL).
  - colocated / disaggregated: always that path, workers from the balancer.
  - threshold (Dynamo's rule): disaggregated iff uncached prompt tokens > T and the prefill
    worker's queue holds fewer than Q requests.
Balancer: the decode worker with the least load (active tokens over capacity, plus KV usage),
except that among workers within `affinity_margin` of the least, the one holding the longest
cached prefix wins; the prefill worker with the least predicted queue time.
Every decision carries the best prediction for each path and a reason in words.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace

from router.convert import RoutePath
from router.cost_model import Bias, HandoffHealth, TransferTimeModel, prefill_pairs
from router.pool_state import WorkerState

# A pair whose recent handoffs fell back more often than this is not chosen while another
# choice remains.
MAX_FAILURE_RATE = 0.5


class Policy(enum.Enum):
    AUTO = "auto"
    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"
    THRESHOLD = "threshold"


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    policy: Policy = Policy.AUTO
    threshold_tokens: int = 256  # threshold policy: T
    threshold_queue: int = 4  # threshold policy: Q
    affinity_margin: float = 0.1  # load-score gap within which prefix affinity decides


@dataclass(frozen=True, slots=True)
class RequestShape:
    prompt_len: int
    hashes: tuple[bytes, ...]  # the prompt's full-block prefix hashes
    max_tokens: int
    slo_ttft_s: float
    slo_itl_s: float


@dataclass(frozen=True, slots=True)
class PathPrediction:
    path: RoutePath
    prefill_worker: str  # "" on the colocated path
    decode_worker: str
    ttft_s: float  # bias included
    raw_ttft_s: float  # the models alone
    itl_s: float  # this request's decode step
    running_itl_s: float  # the step the decode worker's running requests see meanwhile
    running_itl_before_s: float  # ... and would see without this request
    running_itl_slo_s: float  # the tightest ITL SLO among them (inf: none)
    queue_s: float
    prefill_s: float
    transfer_s: float
    uncached_tokens: int
    transfer_bytes: int
    failure_rate: float = 0.0  # of this pair's recent handoffs (disaggregated)

    @property
    def failing(self) -> bool:
        return self.failure_rate > MAX_FAILURE_RATE

    def with_failure_risk(
        self, rate: float, wasted_s: float, local_ttft_s: float
    ) -> PathPrediction:
        """The expected TTFT when a handoff falls back with probability `rate`: the time it
        wastes, then a prefill on the decode worker (`local_ttft_s`)."""
        ttft = (1 - rate) * self.ttft_s + rate * (wasted_s + local_ttft_s)
        return replace(self, ttft_s=ttft, failure_rate=rate)

    @property
    def overshoot_s(self) -> float:
        """How far this request takes a running request's ITL past its SLO (past what work
        already there does anyway, which is not this request's doing)."""
        floor = max(self.running_itl_slo_s, self.running_itl_before_s)
        return max(0.0, self.running_itl_s - floor)

    @property
    def pushes_running(self) -> bool:
        """Past the SLO by more than a tenth of it (one more sequence in a batch that already
        runs at its SLO is not a push; a prefill chunk in its steps is)."""
        return self.overshoot_s > 0.1 * self.running_itl_slo_s

    def rank(self, req: RequestShape) -> tuple[float, float]:
        """Least SLO violation first, then the earliest predicted second token (TTFT + ITL:
        of two equally fast prefills, the less busy decode worker wins)."""
        return self.violation(req), self.ttft_s + self.itl_s

    def violation(self, req: RequestShape) -> float:
        return max(0.0, self.ttft_s / req.slo_ttft_s - 1) + max(0.0, self.itl_s / req.slo_itl_s - 1)


@dataclass(frozen=True, slots=True)
class Decision:
    chosen: PathPrediction
    best: tuple[PathPrediction, ...]  # the best candidate of each path considered
    reason: str  # in words, for logs and the client
    reason_code: str  # a short label, for metrics


def predict_colocated(req: RequestShape, d: WorkerState, bias_s: float) -> PathPrediction:
    cached = d.cached_tokens(req.hashes, req.prompt_len)
    n = req.prompt_len - cached
    tokens = d.queued_tokens + n
    pairs = d.queued_pairs + prefill_pairs(n, cached)
    total, during = d.model.chunked_s(tokens, pairs, d.batch, d.context)
    own, _ = d.model.chunked_s(n, prefill_pairs(n, cached), d.batch, d.context)
    _, before = d.model.chunked_s(d.queued_tokens, d.queued_pairs, d.batch, d.context)
    itl = d.model.decode_step_s(d.batch + 1, d.context + req.prompt_len + req.max_tokens // 2)
    return PathPrediction(
        path=RoutePath.COLOCATED,
        prefill_worker="",
        decode_worker=d.worker_id,
        ttft_s=total + bias_s,
        raw_ttft_s=total,
        itl_s=itl,
        running_itl_s=during if d.batch else 0.0,
        running_itl_before_s=before if d.batch else 0.0,
        running_itl_slo_s=d.min_itl_slo_s,
        queue_s=total - own,
        prefill_s=own,
        transfer_s=0.0,
        uncached_tokens=n,
        transfer_bytes=0,
    )


def predict_disaggregated(
    req: RequestShape,
    p: WorkerState,
    d: WorkerState,
    transfer: TransferTimeModel,
    bias_s: float,
) -> PathPrediction:
    cached_p = p.cached_tokens(req.hashes, req.prompt_len)
    n_p = req.prompt_len - cached_p
    cached_d = d.cached_tokens(req.hashes, req.prompt_len)
    bs = d.info.block_size
    # Whole blocks past the decode worker's hit travel (the last one may be partial).
    n_blocks = -(-req.prompt_len // bs) - cached_d // bs
    nbytes = n_blocks * bs * d.info.kv_bytes_per_token
    own = p.model.prefill_s(n_p, cached_p)
    total, _ = p.model.chunked_s(
        p.queued_tokens + n_p, p.queued_pairs + prefill_pairs(n_p, cached_p), 0, 0
    )
    exposed = transfer.seconds(nbytes)
    raw = total + exposed
    ctx = d.context + req.prompt_len
    return PathPrediction(
        path=RoutePath.DISAGGREGATED,
        prefill_worker=p.worker_id,
        decode_worker=d.worker_id,
        ttft_s=raw + bias_s,
        raw_ttft_s=raw,
        itl_s=d.model.decode_step_s(d.batch + 1, ctx + req.max_tokens // 2),
        running_itl_s=d.model.decode_step_s(d.batch + 1, ctx) if d.batch else 0.0,
        running_itl_before_s=d.model.decode_step_s(d.batch, d.context) if d.batch else 0.0,
        running_itl_slo_s=d.min_itl_slo_s,
        queue_s=total - own,
        prefill_s=own,
        transfer_s=exposed,
        uncached_tokens=req.prompt_len - cached_d,
        transfer_bytes=nbytes,
    )


def pick_decode(req: RequestShape, decode: Sequence[WorkerState], margin: float) -> WorkerState:
    least = min(w.load_score for w in decode)
    close = [w for w in decode if w.load_score <= least + margin]
    return max(close, key=lambda w: (w.prefix.match(req.hashes), -w.load_score))


def pick_prefill(
    prefill: Sequence[WorkerState], d: str = "", health: HandoffHealth | None = None
) -> WorkerState:
    """The prefill worker with the least predicted queue, among those whose pair with decode
    worker `d` is not failing (when any is not)."""

    def failing(w: WorkerState) -> bool:
        return health is not None and health.failure_rate(w.worker_id, d) > MAX_FAILURE_RATE

    return min(
        prefill,
        key=lambda w: (failing(w), w.model.chunked_s(w.queued_tokens, w.queued_pairs, 0, 0)[0]),
    )


def _ms(s: float) -> str:
    return f"{s * 1000:.0f} ms"


class Planner:
    def __init__(
        self,
        config: PolicyConfig,
        transfer: TransferTimeModel,
        health: HandoffHealth | None = None,
    ) -> None:
        self.config = config
        self.transfer = transfer
        self.health = health or HandoffHealth()
        self.bias = {RoutePath.COLOCATED: Bias(), RoutePath.DISAGGREGATED: Bias()}

    def candidates(
        self, req: RequestShape, prefill: Sequence[WorkerState], decode: Sequence[WorkerState]
    ) -> list[PathPrediction]:
        out = [predict_colocated(req, d, self.bias[RoutePath.COLOCATED].offset_s) for d in decode]
        local = {c.decode_worker: c.ttft_s for c in out}
        b = self.bias[RoutePath.DISAGGREGATED].offset_s
        for p in prefill:
            for d in decode:
                c = predict_disaggregated(req, p, d, self.transfer, b)
                rate = self.health.failure_rate(p.worker_id, d.worker_id)
                if rate > 0:
                    wasted = self.health.wasted_s(p.worker_id, d.worker_id)
                    c = c.with_failure_risk(rate, wasted, local[d.worker_id])
                out.append(c)
        return out

    def decide(
        self,
        req: RequestShape,
        prefill: Sequence[WorkerState],
        decode: Sequence[WorkerState],
        override: RoutePath = RoutePath.AUTO,
    ) -> Decision:
        cands = self.candidates(req, prefill, decode)
        best = tuple(
            min(group, key=lambda c: c.rank(req))
            for path in (RoutePath.COLOCATED, RoutePath.DISAGGREGATED)
            if (group := [c for c in cands if c.path is path])
        )
        if override is not RoutePath.AUTO:
            return self._fixed(req, override, prefill, decode, cands, best, "override")
        policy = self.config.policy
        if policy is Policy.AUTO:
            return self._auto(req, cands, best)
        if policy is Policy.THRESHOLD:
            return self._threshold(req, prefill, decode, cands, best)
        path = RoutePath.COLOCATED if policy is Policy.COLOCATED else RoutePath.DISAGGREGATED
        return self._fixed(req, path, prefill, decode, cands, best, "policy")

    def _find(self, cands: list[PathPrediction], path: RoutePath, p: str, d: str) -> PathPrediction:
        return next(
            c for c in cands if c.path is path and c.prefill_worker == p and c.decode_worker == d
        )

    def _fixed(
        self,
        req: RequestShape,
        path: RoutePath,
        prefill: Sequence[WorkerState],
        decode: Sequence[WorkerState],
        cands: list[PathPrediction],
        best: tuple[PathPrediction, ...],
        why: str,
    ) -> Decision:
        d = pick_decode(req, decode, self.config.affinity_margin).worker_id
        if path is RoutePath.DISAGGREGATED and not prefill:
            chosen = self._find(cands, RoutePath.COLOCATED, "", d)
            return Decision(
                chosen,
                best,
                "disaggregated asked, but no prefill worker is up",
                "no_prefill_workers",
            )
        p = ""
        if path is RoutePath.DISAGGREGATED:
            p = pick_prefill(prefill, d, self.health).worker_id
        chosen = self._find(cands, path, p, d)
        label = "requested by the client" if why == "override" else f"--policy {path.name.lower()}"
        return Decision(chosen, best, f"{path.name.lower()}: {label}", why)

    def _auto(
        self, req: RequestShape, cands: list[PathPrediction], best: tuple[PathPrediction, ...]
    ) -> Decision:
        usable = [c for c in cands if not c.failing] or cands
        safe = [c for c in usable if not c.pushes_running]
        if safe:
            chosen = min(safe, key=lambda c: c.rank(req))
        else:  # every choice pushes: the one that pushes least
            chosen = min(usable, key=lambda c: (c.overshoot_s, *c.rank(req)))
        others = [c for c in best if c.path is not chosen.path]
        parts = [f"{chosen.path.name.lower()}: predicted TTFT {_ms(chosen.ttft_s)}"]
        code = "cost_ttft"
        for o in others:
            if o.failing and len(usable) < len(cands):
                parts.append(
                    f"{o.path.name.lower()} handoffs {o.prefill_worker}->{o.decode_worker} keep "
                    f"falling back (failure rate {o.failure_rate:.2f})"
                )
                code = "handoff_failing"
            elif o.pushes_running and safe:
                parts.append(
                    f"{o.path.name.lower()} would raise {o.decode_worker}'s ITL to "
                    f"{_ms(o.running_itl_s)}, past its SLO {_ms(o.running_itl_slo_s)}"
                )
                code = "itl_guard"
            else:
                parts.append(f"vs {_ms(o.ttft_s)} {o.path.name.lower()}")
        if code == "cost_ttft" and chosen.violation(req) > 0:
            code = "cost_slo_miss"  # nothing meets the SLO: least violation
        elif code == "cost_ttft" and any(o.violation(req) > 0 for o in others):
            code = "cost_slo"
        if not safe:
            parts.append(
                "every choice pushes a running request past its ITL SLO; this one least "
                f"(+{_ms(chosen.overshoot_s)})"
            )
        return Decision(chosen, best, "; ".join(parts), code)

    def _threshold(
        self,
        req: RequestShape,
        prefill: Sequence[WorkerState],
        decode: Sequence[WorkerState],
        cands: list[PathPrediction],
        best: tuple[PathPrediction, ...],
    ) -> Decision:
        d = pick_decode(req, decode, self.config.affinity_margin)
        uncached = req.prompt_len - d.cached_tokens(req.hashes, req.prompt_len)
        t, q = self.config.threshold_tokens, self.config.threshold_queue
        if prefill:
            p = pick_prefill(prefill, d.worker_id, self.health)
            if uncached > t and p.queued_prefills < q:
                chosen = self._find(cands, RoutePath.DISAGGREGATED, p.worker_id, d.worker_id)
                why = f"disaggregated: {uncached} uncached tokens > {t}, prefill queue < {q}"
                return Decision(chosen, best, why, "threshold_remote")
        chosen = self._find(cands, RoutePath.COLOCATED, "", d.worker_id)
        if not prefill:
            why = "colocated: no prefill worker is up"
        elif uncached <= t:
            why = f"colocated: {uncached} uncached tokens <= {t}"
        else:
            why = f"colocated: the prefill queue holds >= {q} requests"
        return Decision(chosen, best, why, "threshold_local")
