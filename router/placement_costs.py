"""What one placement of a request would cost, from the workers' books and models: for the
colocated path on a decode worker D (or a prefill worker answering a request of one token), and
for the disaggregated path over a pair (P, D), the predicted TTFT (queue + prefill + exposed
transfer, with the path's bias), the request's own ITL, the ITL that the requests already
decoding on D (and on P, when P decodes too) see meanwhile, the SLO misses it causes among the
running requests (on D and P, and on their node's other workers, which a worker set decoding
slows where they share the node), and where it stands in the tie-break (the prefill beside
decodes, the decode worker's lean). Each comes out as a PathPrediction (router/predictions.py),
which says what it comes to in SLO misses."""

from __future__ import annotations

from dataclasses import replace

from router.cost_model import prefill_pairs
from router.handoff_model import TransferTimeModel
from router.interference import (
    beside_floor,
    caused_misses,
    coming_chunk_step,
    coming_step,
    decode_step_beside,
    prefill_end_s,
    prefills_beside,
)
from router.pool_state import WorkerState
from router.predictions import PathPrediction, RequestShape
from router.spread import MISS_WIDTH
from router.ttft_bias import Bias
from router.vocab import RoutePath
from worker_protocol.messages import WorkerRole

# Decodes gather on a worker of both kinds while its KV is under this share of its capacity.
GATHER_MAX_LOAD = 0.8
# The tie-break's lean of a prefill worker answering a request of one token: before any other.
ANSWER_LEAN = (False, False, -1)


def predict_colocated(
    req: RequestShape,
    d: WorkerState,
    bias: Bias,
    shared: float = 0.0,
    ttft_width: float = MISS_WIDTH,
) -> PathPrediction:
    """`shared`: the misses setting `d` decoding causes on its node's other workers
    (shared_misses); `ttft_width`: how far TTFT predictions have erred (router/spread.py)."""
    cached = d.cached_tokens(req.hashes, req.prompt_len)
    n = req.prompt_len - cached
    tokens = d.queued_tokens + n
    pairs = d.queued_pairs + prefill_pairs(n, cached)
    hold = req.prefill_hold_s
    _, during = d.model.chunked_s(tokens, pairs, d.batch, d.context, hold)
    total = prefill_end_s(d, n, prefill_pairs(n, cached), hold)
    own, _ = d.model.chunked_s(n, prefill_pairs(n, cached), d.batch, d.context, hold)
    _, before = d.model.chunked_s(d.queued_tokens, d.queued_pairs, d.batch, d.context)
    itl = d.model.decode_step_s(d.batch + 1, d.context + req.prompt_len + req.max_tokens // 2)
    # The step the requests to decode here after their local prefill see beside this one.
    coming = coming_chunk_step(d, n, prefill_pairs(n, cached))
    prediction = PathPrediction(
        path=RoutePath.COLOCATED,
        prefill_worker="",
        decode_worker=d.worker_id,
        ttft_s=bias.apply(total),
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
        caused_misses=caused_misses(d, during, before, coming) + shared,
        itl_tail=d.measured.gap_tail(),
        itl_floor_s=d.measured.typical_gap(),
        ttft_width=ttft_width,
        itl_width=d.measured.itl_spread.width,
        itl_beside_s=beside_floor(d, d.batch + 1, d.context + req.prompt_len, itl),
        itl_gap_factor=d.measured.gap_factor(),
        itl_bias=d.measured.itl_bias_factor(local=True),
        prefill_beside=prefills_beside(d, during, coming),
        decode_lean=_lean(d, _prefills_beside_coming(d, n, cached, req), req.decodes),
        answered=d.info.role == WorkerRole.PREFILL,  # one token (candidates.answering)
    )
    return prediction if req.decodes else _without_gaps(prediction)


def predict_disaggregated(
    req: RequestShape,
    p: WorkerState,
    d: WorkerState,
    transfer: TransferTimeModel,
    bias: Bias,
    shared: float = 0.0,
    ttft_width: float = MISS_WIDTH,
) -> PathPrediction:
    """`shared`, `ttft_width`: as for predict_colocated."""
    cached_p = p.cached_tokens(req.hashes, req.prompt_len)
    n_p = req.prompt_len - cached_p
    cached_d = d.cached_tokens(req.hashes, req.prompt_len)
    bs = d.info.block_size
    # Whole blocks past the decode worker's hit travel (the last one may be partial).
    n_blocks = -(-req.prompt_len // bs) - cached_d // bs
    nbytes = n_blocks * bs * d.info.kv_bytes_per_token
    # P's own running decodes (a worker that does both) share its steps with the prefill: it
    # takes longer in chunks, and they see slower steps meanwhile.
    hold = req.prefill_hold_s
    own, _ = p.model.chunked_s(n_p, prefill_pairs(n_p, cached_p), p.batch, p.context, hold)
    _, p_during = p.model.chunked_s(
        p.queued_tokens + n_p,
        p.queued_pairs + prefill_pairs(n_p, cached_p),
        p.batch,
        p.context,
        hold,
    )
    total = prefill_end_s(p, n_p, prefill_pairs(n_p, cached_p), hold)
    exposed = transfer.seconds(nbytes)
    raw = total + exposed
    ctx = d.context + req.prompt_len
    caused = 0.0
    p_coming = coming_chunk_step(p, n_p, prefill_pairs(n_p, cached_p))
    if p.batch or p.local_prefills:  # decoding there, or to decode there (colocated)
        _, p_before = p.model.chunked_s(p.queued_tokens, p.queued_pairs, p.batch, p.context)
        caused += caused_misses(p, p_during, p_before, p_coming)
    # On D, prefills queued there (local ones, or a worker that does both prefilling for a peer)
    # share the steps of those already decoding, and of the request once it decodes if they
    # outlast its prefill and transfer.
    d_queue_s = prefill_end_s(d, 0, 0.0)
    step = decode_step_beside if d_queue_s > raw else (lambda w, n, c: w.model.decode_step_s(n, c))
    itl = step(d, d.batch + 1, ctx + req.max_tokens // 2)
    running = before = 0.0
    if d.batch or d.local_prefills:
        running = decode_step_beside(d, d.batch + 1, ctx)
        before = decode_step_beside(d, d.batch, d.context)
        caused += caused_misses(d, running, before, coming_step(d, 1, req.prompt_len))
    caused += shared
    prediction = PathPrediction(
        path=RoutePath.DISAGGREGATED,
        prefill_worker=p.worker_id,
        decode_worker=d.worker_id,
        ttft_s=bias.apply(raw),
        raw_ttft_s=raw,
        itl_s=itl,
        running_itl_s=running,
        running_itl_before_s=before,
        running_itl_slo_s=d.min_itl_slo_s,
        queue_s=total - own,
        prefill_s=own,
        transfer_s=exposed,
        uncached_tokens=req.prompt_len - cached_d,
        transfer_bytes=nbytes,
        caused_misses=caused,
        p_running_itl_s=p_during if p.batch else 0.0,
        itl_tail=d.measured.gap_tail(),
        itl_floor_s=d.measured.typical_gap(),
        ttft_width=ttft_width,
        itl_width=d.measured.itl_spread.width,
        itl_beside_s=beside_floor(d, d.batch + 1, ctx, itl),
        itl_gap_factor=d.measured.gap_factor(),
        itl_bias=d.measured.itl_bias_factor(local=False),
        prefill_beside=prefills_beside(p, p_during, p_coming),
        decode_lean=_lean(d, d.queued_prefills > 0, req.decodes),
    )
    return prediction if req.decodes else _without_gaps(prediction)


def _without_gaps(c: PathPrediction) -> PathPrediction:
    """The prediction for a request of one token (RequestShape.decodes): it has no gaps, so no
    ITL of its own to predict or miss (the running requests' it slows stay), and nothing to
    check against one."""
    return replace(c, itl_s=0.0, itl_floor_s=0.0, itl_beside_s=0.0)


def _prefills_beside_coming(d: WorkerState, n: int, cached: int, req: RequestShape) -> bool:
    """Whether prefilling `req` on its decode worker `d` (colocated: `n` tokens past a `cached`
    prefix) runs a prefill beside the decodes to come there: always on a worker of both kinds
    (it breaks the split), and on a dedicated decode worker where its compute alone takes
    longer than the request's ITL SLO, or others are queued there. One shorter than that pushes
    no decode that comes meanwhile past its SLO: a short prompt prefilled there is a step's
    work, and takes the quicker first token."""
    if d.info.role == WorkerRole.BOTH:
        return True
    return d.queued_prefills > 0 or d.model.prefill_s(n, cached) > req.slo_itl_s


def _lean(d: WorkerState, prefills_there: bool, decodes: bool = True) -> tuple[bool, bool, int]:
    """See PathPrediction.decode_lean: a dedicated decode worker comes first, then a worker of
    both kinds; of each, one where no prefill runs comes before one where one does
    (`prefills_there`: the request's own, colocated (see _prefills_beside_coming), or others
    queued there: its decodes would run beside them, and a worker that prefills and decodes
    breaks the split). Without it on dedicated pools, at 1P+1D with every other component tied
    on idle workers, the quicker first token decided: `auto` colocated a 918-token prompt of a
    burst on the decode worker in both rounds of bursty at c9aa841, beside the decodes of the
    requests right after it. Then, of workers of both kinds, one that gathers decodes while it
    has room (a free sequence slot, KV under GATHER_MAX_LOAD), past which it comes last, the
    fullest last. Its decodes count those running and those to come: the requests it prefills
    to decode itself. A request of one token (not `decodes`) adds a prefill and no decode: it
    leans to a prefill worker (ANSWER_LEAN: no decodes ever run there), then to where the
    fewest decodes run or are to come (prefills go where none run)."""
    n = d.batch + d.local_prefills
    if not decodes:
        return ANSWER_LEAN if d.info.role == WorkerRole.PREFILL else (False, n > 0, n)
    if d.info.role != WorkerRole.BOTH:
        return False, prefills_there, 0
    room = n + 1 <= d.info.max_num_seqs and d.load_score < GATHER_MAX_LOAD
    return True, prefills_there, -n if room else n
