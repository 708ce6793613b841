"""The StatsSink the request core reports to (router/stats.py's records), and the workers' load
reports, recorded into the router's Prometheus metrics (router/metric_families.py, where every
name and label is defined), and /metrics served. Refusals also go to the log
(router/refusal_log.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import disable_created_metrics, start_http_server

from router.host_share import PeerWork
from router.metric_families import MetricFamilies
from router.refusal_log import RefusalLog, Said
from router.stats import FirstTokenRecord, RequestRecord, TransferRecord
from router.vocab import PLACEMENT_KINDS, Frontend, RejectReason
from worker_protocol.messages import WorkerLoad, WorkerRole

# No `*_created` series beside each counter and histogram (a tenth of the series, which neither
# the dashboard nor the alerts read), in the server as in its tests.
disable_created_metrics()

log = logging.getLogger("pdserve.pools")


class Metrics(MetricFamilies):
    """The metrics of one router, and what records into them."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, WorkerLoad] = {}
        self._kinds_seen: set[tuple[str, str, str]] = set()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.refusals = RefusalLog()  # each refusal counted here is also said in the log
        # Requests each worker preempted (its KV cache full: their blocks freed, recomputed
        # later), said in the log.
        self._preempted: dict[str, Said] = {}

    def _c(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once (the request path calls these per token)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def serve(self, host: str, port: int) -> int:
        """Expose /metrics on host:port (0: any free port); returns the port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return int(server.server_address[1])

    def close(self) -> None:
        self.refusals.flush()  # the last refusals counted reach the log too
        server = getattr(self, "_http", None)
        if server is not None:
            server.shutdown()
            server.server_close()

    # -- the StatsSink the core reports to ------------------------------------------------------
    def decided(self, path: str, reason: str) -> None:
        self._c(self.decisions, path, reason).inc()

    def rejected(self, reason: RejectReason, frontend: Frontend) -> None:
        self._c(self.rejections, reason.value, frontend.value).inc()
        self.refusals.refused(reason, frontend)

    def first_token(self, rec: FirstTokenRecord) -> None:
        p = rec.path
        self._c(self.ttft, p, rec.frontend.value).observe(rec.ttft_s)
        self._c(self.queue, p).observe(rec.queue_s)
        if rec.prefill_s is not None:
            self._c(self.prefill, p).observe(rec.prefill_s)
        self._c(self.predicted_ttft, p).observe(rec.predicted_ttft_s)
        if rec.ttft_s > 0:
            err = abs(rec.predicted_ttft_s - rec.ttft_s) / rec.ttft_s
            self._c(self.prediction_error, p).observe(err)

    def streamed(self, path: str, tokens: int, gaps_s: Sequence[float]) -> None:
        self._c(self.generation_tokens, path).inc(tokens)
        itl = self._c(self.itl, path)
        for gap in gaps_s:
            itl.observe(gap)

    def finished(self, rec: RequestRecord) -> None:
        p = rec.path
        self._c(self.requests, p, rec.finish_reason, rec.frontend.value).inc()
        if rec.length_reason is not None:
            self._c(self.cut_short, p, rec.length_reason).inc()
        self._c(self.prompt_tokens, p).inc(rec.prompt_tokens)
        self._c(self.cached_prompt_tokens, p).inc(rec.cached_prompt_tokens)
        self._c(self.e2e, p).observe(rec.e2e_s)
        if rec.ttft_s is not None and rec.output_tokens > 1:
            self._c(self.tpot, p).observe((rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1))

    def transferred(self, rec: TransferRecord) -> None:
        if rec.ok:
            self.transfer.observe(rec.seconds)
            self.transfer_bytes.inc(rec.bytes)
            self.transfers.inc()
            if rec.seconds > 0:
                self.bandwidth.set(rec.bytes / rec.seconds)
        else:
            self.transfer_failures.labels(rec.reason or "error").inc()

    def loads(self, loads: Sequence[WorkerLoad]) -> None:
        for ld in loads:
            w = (ld.worker_id, ld.role.value)
            self.running.labels(*w).set(ld.running)
            self.waiting.labels(*w).set(ld.waiting + ld.waiting_for_kv)
            self.kv_usage.labels(*w).set(ld.kv_usage)
            self.queued_tokens.labels(*w).set(ld.queued_prefill_tokens)
            last = self._last.get(ld.worker_id)
            if last is not None and last.incarnation != ld.incarnation:
                last = None  # a new incarnation: its totals are its own
            # The worker reports totals since its warm-up ended: add the growth (all of it for a
            # new incarnation, or where a total went down).
            for counter, now, before in (
                (self.prefix_queries, ld.prefix_queries, last.prefix_queries if last else 0),
                (self.prefix_hits, ld.prefix_hits, last.prefix_hits if last else 0),
                (self.preemptions, ld.preemptions, last.preemptions if last else 0),
                (self.busy, ld.busy_s, last.busy_s if last else 0.0),
                (
                    self.prompt_wait_steps,
                    ld.prompt_wait_steps,
                    last.prompt_wait_steps if last else 0,
                ),
            ):
                counter.labels(*w).inc(now - before if now >= before else now)
            before = last.preemptions if last else 0
            grew = ld.preemptions - before if ld.preemptions >= before else ld.preemptions
            if grew > 0:
                said = self._preempted.setdefault(ld.worker_id, Said(log, logging.WARNING))
                said.say(
                    time.monotonic(),
                    "worker %s preempted %d requests: its KV cache was full, so their blocks "
                    "were freed and they are recomputed from their prompts and outputs (they "
                    "take longer). More KV-cache memory (--kv-cache-gib) or fewer sequences "
                    "per worker (--max-num-seqs) avoids it",
                    ld.worker_id,
                    grew,
                    n=grew,
                )
            # Exist at 0, so that a first failure or hang is an increase.
            self.worker_failures.labels(*w)
            self.worker_hangs.labels(*w)
            self._last[ld.worker_id] = ld

    def workers(self, ready: dict[WorkerRole, int]) -> None:
        for role, n in ready.items():
            self.live_workers.labels(role.value).set(n)

    def prefill_placed(self, worker_id: str, role: str, for_peer: bool) -> None:
        kind = "for_peer" if for_peer else "local"
        self._c(self.prefills, worker_id, role, kind).inc()
        if (worker_id, role, "local" if for_peer else "for_peer") not in self._kinds_seen:
            # Both kinds exist once either does, so that the first of the other is an increase.
            self.prefills.labels(worker_id, role, "local" if for_peer else "for_peer")
        self._kinds_seen.add((worker_id, role, kind))

    def decoding(self, running: dict[tuple[str, str], int]) -> None:
        for (worker_id, role), n in running.items():
            self.decodes.labels(worker_id, role).set(n)

    def node_shares(self, shares: dict[tuple[str, PeerWork], float]) -> None:
        for (node, peer), factor in shares.items():
            self.node_share.labels(node, peer.value).set(factor)

    def spreads(self, widths: dict[tuple[str, str], float]) -> None:
        for (kind, worker_id), width in widths.items():
            self.prediction_spread.labels(kind, worker_id).set(width)

    def gap_factors(self, factors: dict[str, float]) -> None:
        for worker_id, factor in factors.items():
            self.gap_factor.labels(worker_id).set(factor)

    def biases(self, factors: dict[tuple[str, str], float]) -> None:
        for (kind, worker_id), factor in factors.items():
            self.prediction_bias.labels(kind, worker_id).set(factor)

    def worker_lost(self, worker_id: str, role: str) -> None:
        self.worker_failures.labels(worker_id, role).inc()
        self.worker_removed(worker_id, role)

    def worker_hung(self, worker_id: str, role: str) -> None:
        self.worker_hangs.labels(worker_id, role).inc()

    def worker_removed(self, worker_id: str, role: str) -> None:
        for g in (self.running, self.waiting, self.kv_usage, self.queued_tokens, self.decodes):
            try:
                g.remove(worker_id, role)
            except KeyError:
                pass
        for g, labels in (
            (self.prediction_spread, ("itl_p99", worker_id)),
            (self.gap_factor, (worker_id,)),
            *((self.prediction_bias, (kind, worker_id)) for kind, _ in PLACEMENT_KINDS),
        ):
            try:
                g.remove(*labels)
            except KeyError:
                pass
        self._last.pop(worker_id, None)  # a later incarnation reports totals from 0

    def worker_restarted(self, role: str, times: int) -> None:
        if times > 0:
            self.worker_restarts.labels(role).inc(times)

    def fell_back(self, reason: str) -> None:
        self._c(self.fallbacks, reason).inc()

    def replanned(self) -> None:
        self.replans.inc()

    def moved(self) -> None:
        self.resumed.inc()
