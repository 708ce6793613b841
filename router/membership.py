"""The request core's view of who is in the pools: one set of books (router/pool_state.py) per
worker incarnation, kept in step with the backend, and the membership changes reported to the
stats sink (deaths, replacements, removals, how many take requests)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from router.core_types import Backend
from router.cost_model import kin_of
from router.handoff_model import HandoffHealth
from router.host_share import BUSY, HostShare
from router.pool_state import WorkerState, peer_work
from router.stats import StatsSink
from router.vocab import PLACEMENT_KINDS
from worker_protocol.messages import WorkerInfo, WorkerLoad, WorkerRole

log = logging.getLogger("pdserve.router")
# A worker's steps run with prompts waiting for its decodes are logged at most this often.
WAIT_LOG_S = 10.0


class Membership:
    def __init__(
        self,
        backend: Backend,
        infos: Sequence[WorkerInfo],
        health: HandoffHealth,
        sink: StatsSink,
    ) -> None:
        self.backend = backend
        self.health = health
        self.sink = sink
        self.states = {i.worker_id: WorkerState(i) for i in infos}
        # One HostShare per node, shared by the books of the workers on it.
        self._hosts: dict[str, HostShare] = {}
        for state in self.states.values():
            self._share_node(state)
        # Ids out of the pools whose per-worker series the sink has removed; an id is taken
        # out again once a read of the pools finds it there (a scale-up took it again).
        self._gone: set[str] = set()
        self._deaths_seen = 0  # of backend.dead, already reported
        self._hangs_seen = 0  # of backend.hung, already reported
        self._restarts_seen: dict[WorkerRole, int] = {}  # backend.restarts, already reported
        # Per worker incarnation: (when logged, steps run with prompts waiting then).
        self._waits_logged: dict[tuple[str, int], tuple[float, int]] = {}

    def state(self, worker_id: str) -> WorkerState:
        """The books of a worker's current incarnation; a new incarnation (a replacement) gets
        fresh books: its prefix cache and queues start empty, its pairs' health too. How far its
        predictions erred and their bias per kind of placement carry over, in force from its
        first decision (the same model on the same kind of device), and its gaps over its steps
        (the same process and transport): WorkerState.carry."""
        info = self.backend.worker_info(worker_id)
        old = self.states.get(worker_id)
        state = old
        if state is None or state.info.incarnation != info.incarnation:
            state = self.states[worker_id] = WorkerState(info)
            if old is not None:
                self.health.forget(worker_id)
                state.carry(old)
            self._share_node(state)
        return state

    def _share_node(self, state: WorkerState) -> None:
        """Give `state` its node's HostShare (a worker whose node is unknown keeps its own)."""
        node = state.info.node_ip
        if node:
            if node not in self._hosts:
                self._hosts[node] = HostShare.for_device(state.info.device)
            state.host = self._hosts[node]

    def pools(self) -> tuple[list[WorkerState], list[WorkerState]]:
        """The books of the workers that take requests now: (prefill, decode)."""
        prefill, decode = self.backend.prefill_ids, self.backend.decode_ids  # one read of each
        if self._gone:  # back in a pool: its series may be set again, and removed once it leaves
            self._gone.difference_update(prefill)
            self._gone.difference_update(decode)
        return [self.state(w) for w in prefill], [self.state(w) for w in decode]

    def _log_waits(self, state: WorkerState, load: WorkerLoad) -> None:
        """Log a worker's steps run with prompts waiting for its decodes (--prefill-hold-ms)
        when their count grew, at most every WAIT_LOG_S."""
        now = time.monotonic()
        key = (state.worker_id, load.incarnation)
        at, seen = self._waits_logged.get(key, (-WAIT_LOG_S, 0))
        if load.prompt_wait_steps <= seen or now - at < WAIT_LOG_S:
            return
        self._waits_logged[key] = (now, load.prompt_wait_steps)
        log.info(
            "%s ran %d steps with prompts waiting for its decodes (%d since start; its smallest "
            "chunk beside decodes %.0f ms, step target %.0f ms)",
            state.worker_id,
            load.prompt_wait_steps - seen,
            load.prompt_wait_steps,
            (load.chunk_floor_s or 0.0) * 1000,
            (state.model.step_target_s or 0.0) * 1000,
        )

    def absorb(self, loads: Sequence[WorkerLoad]) -> None:
        """The workers' polled load, into the books of the incarnation that reported it; then
        what changed in the pools since the last call, to the sink. One read of the pools
        serves the whole call: the figures go to the sink for the workers in it, and the
        series of those out of it are removed, so that none is set for a worker that left."""
        prefill, decode = self.pools()  # books for workers that joined since
        live = {s.worker_id: s for s in [*prefill, *decode]}  # a worker doing both: once
        members = list(live.values())
        for s in members:  # what a worker's fit has not seen, its kin's may have
            s.model.kin = [o.model for o in members if o is not s and kin_of(s.info, o.info)]
        for load in loads:
            state = self.states.get(load.worker_id)
            if state is not None and state.info.incarnation == load.incarnation:
                state.absorb(load, peer_work(state, members))
                state.measured.update_tail()
                self._log_waits(state, load)
        factors = [f for s in members if (f := s.measured.own_gap_factor) is not None]
        if factors:  # a worker not yet measured takes what the others did
            peers = float(np.median(factors))
            for s in members:
                s.measured.peers_gap_factor = peers
        self._report(live, decode, loads)
        self._report_changes()
        for w, state in self.states.items():
            if w not in live and w not in self._gone:
                self._gone.add(w)  # dead, removed by a resize, or a replacement not up yet
                self.sink.worker_removed(w, state.info.role.value)

    def _report(
        self, live: dict[str, WorkerState], decode: list[WorkerState], loads: Sequence[WorkerLoad]
    ) -> None:
        """The per-worker figures of the workers in the pools (`live`), to the sink. A load
        report of a worker out of them sets none, whatever its incarnation: its series were
        removed, or are about to be, and nothing would remove them again (a draining worker
        still answers polls; a poll's answer may come after its worker left, and so may that
        of a replacement stopped before it was up). Nor does one of an incarnation other than
        its id's current one (a late answer of the one replaced): its figures are stale, and
        its totals would count again into the counters."""
        self.sink.gap_factors({s.worker_id: s.measured.gap_factor() for s in decode})
        self.sink.biases(
            {
                (kind, s.worker_id): s.measured.itl_bias_factor(local)
                for s in decode
                for kind, local in PLACEMENT_KINDS
            }
        )
        self.sink.loads(
            [
                ld
                for ld in loads
                if (s := live.get(ld.worker_id)) is not None
                and s.info.incarnation == ld.incarnation
            ]
        )
        counts = dict.fromkeys(WorkerRole, 0)
        for s in live.values():
            counts[s.info.role] += 1
        self.sink.workers(counts)
        self.sink.decoding({(w, s.info.role.value): s.batch for w, s in live.items()})
        self.sink.node_shares(
            {(node, k): share.factor(k) for node, share in self._hosts.items() for k in BUSY}
        )

    def _report_changes(self) -> None:
        """Restarts, deaths and hangs since the last call, to the sink."""
        b = self.backend
        for role, n in b.restarts.items():
            if n > self._restarts_seen.get(role, 0):
                self.sink.worker_restarted(role.value, n - self._restarts_seen.get(role, 0))
                self._restarts_seen[role] = n
        deaths = b.dead[self._deaths_seen :]
        self._deaths_seen += len(deaths)
        for w in deaths:
            state = self.states.get(w)
            self.sink.worker_lost(w, state.info.role.value if state else "unknown")
        hangs = b.hung[self._hangs_seen :]
        self._hangs_seen += len(hangs)
        for w in hangs:
            state = self.states.get(w)
            self.sink.worker_hung(w, state.info.role.value if state else "unknown")
