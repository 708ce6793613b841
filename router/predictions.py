"""What one placement of a request would cost: for the colocated path on a decode worker D, and
for the disaggregated path over a pair (P, D), the predicted TTFT (queue + prefill + exposed
transfer, with the path's bias), the request's own ITL, and the ITL that D's running requests
see meanwhile. The policies (router/policy.py) choose among these."""

from __future__ import annotations

from dataclasses import dataclass, replace

from router.cost_model import TransferTimeModel, prefill_pairs
from router.pool_state import WorkerState
from router.vocab import RoutePath

# A pair whose recent handoffs fell back more often than this is not chosen while another
# choice remains.
MAX_FAILURE_RATE = 0.5


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
