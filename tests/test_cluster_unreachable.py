"""A worker Ray cannot reach for now (ActorUnavailableError: it may come back), as the cluster
meets it, on stand-in actors (no Ray runtime): the request it was streaming goes on elsewhere,
and aborts on it are tried again until they land, so that its blocks are freed once it answers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from dataclasses import replace
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from engine.sampling_params import SamplingParams
from router import cluster as cluster_module
from router import worker_calls
from router.cluster import Cluster
from router.cluster_config import ClusterConfig
from router.errors import HandoffFailed, WorkerLost
from router.handoffs import Handoffs
from router.pools import Pools
from router.vocab import FallbackReason, Placement, RoutePath
from router.workers import WorkerHandle, WorkerStatus
from worker_protocol.messages import TokenChunk, WorkerRole


class Actor:
    """A worker's actor: `abort` fails as `abort_fails` says, one try after another (an
    exception raises it, None answers); `generate` streams one token and then raises `cut`."""

    def __init__(self, *abort_fails: BaseException | None, cut: BaseException | None = None):
        self.abort_fails = deque(abort_fails)
        self.aborts: list[str] = []
        self.abort = SimpleNamespace(remote=self._abort)
        self.generate = SimpleNamespace(options=lambda **_: SimpleNamespace(remote=self._gen))
        self.cut = cut

    async def _abort(self, rid: str) -> None:
        self.aborts.append(rid)
        if self.abort_fails and (exc := self.abort_fails.popleft()) is not None:
            raise exc

    def _gen(self, req):
        async def refs():
            yield _ready(TokenChunk(req.request_id, (7,), False))
            raise self.cut

        return refs()


async def _ready(value):
    return value


def unavailable() -> ActorUnavailableError:
    return ActorUnavailableError("the connection to it broke", None)


def _cluster(*handles: WorkerHandle, timeout_s: float = 5.0) -> Cluster:
    """A Cluster over `handles` without Ray: what generate and the aborts read of it."""
    c = Cluster.__new__(Cluster)
    c.config = ClusterConfig(control_timeout_s=timeout_s)
    workers = {h.worker_id: h for h in handles}
    # The supervisor loop's work (pools.ops) is kept, to be run by the test.
    c.submitted = []  # type: ignore[attr-defined]
    ops = SimpleNamespace(submit=c.submitted.append)  # type: ignore[attr-defined]
    c.pools = SimpleNamespace(workers=workers, note_failure=lambda h, exc: False, ops=ops)
    c.pools.holds = lambda h: Pools.holds(c.pools, h)  # type: ignore[arg-type]  # the real test
    c.handoffs = Handoffs(c.config, c.pools, lambda: [])  # type: ignore[arg-type]
    c._rr = itertools.count()
    return c


def _handle(worker_id: str, actor: Actor) -> WorkerHandle:
    return WorkerHandle(worker_id, WorkerRole.DECODE, actor, 0, status=WorkerStatus.READY)


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(worker_calls, "UNAVAILABLE_RETRY_S", 0.01)


def test_an_abort_is_tried_once_in_line_and_again_later_while_its_worker_is_unreachable(caplog):
    """One try at once; a worker unreachable for now gets the rest on the supervisor loop until
    it answers (or the control timeout, then a warning); a dead one, none."""
    back = _handle("decode-0", Actor(unavailable(), unavailable(), None))
    dead = _handle("decode-1", Actor(ActorDiedError()))
    away = _handle("decode-2", Actor(*[unavailable()] * 1000))
    c = _cluster(back, dead, away, timeout_s=0.3)
    with caplog.at_level(logging.WARNING, logger=cluster_module.log.name):
        for h in (back, dead, away):
            asyncio.run(c._abort(["r"], None, h))
        assert [len(h.actor.aborts) for h in (back, dead, away)] == [1, 1, 1]
        assert len(c.submitted) == 2 and not caplog.records  # back's and away's, for later
        assert [asyncio.run(later) for later in c.submitted] == [True, False]
    assert back.actor.aborts == ["r"] * 3  # answered at the third try
    assert dead.actor.aborts == ["r"]  # dead: nothing left there to free
    assert 5 <= len(away.actor.aborts) <= 40  # tried again until the control timeout
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "abort of r on decode-2 failed: ActorUnavailableError" in warned[0]
    h = _handle("decode-3", Actor(unavailable(), None))
    assert asyncio.run(c.handoffs._abort_on(h, "r")) is False  # not yet: one try
    assert asyncio.run(c.submitted[-1]) is True and h.actor.aborts == ["r", "r"]


def test_a_stream_cut_by_an_unreachable_decode_worker_goes_on_elsewhere_and_is_aborted_there():
    """The request core resumes a request whose decode worker is lost (WorkerLost); a worker
    unreachable for now counts as lost for the request it was streaming, at once, and the
    abort there lands once the worker answers again. Another error still reaches the caller as
    it is (after its abort, in line)."""
    d = _handle("decode-0", Actor(unavailable(), None, cut=unavailable()))
    c = _cluster(d)
    placement = Placement(path=RoutePath.COLOCATED, request_id="req-1", decode_worker="decode-0")

    async def run() -> list[TokenChunk]:
        got = []
        async for chunk in c.generate([1, 2, 3], SamplingParams(max_tokens=4), placement):
            got.append(chunk)
        return got

    with pytest.raises(WorkerLost, match="decode-0 lost: unreachable"):
        asyncio.run(run())
    # It resumes after one try of the abort; the rest on the supervisor loop until D answers.
    assert d.actor.aborts == ["req-1"] and d.active == 0 and len(c.submitted) == 1
    assert asyncio.run(c.submitted[0]) is True and d.actor.aborts == ["req-1", "req-1"]
    other = _handle("decode-0", Actor(None, cut=ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        asyncio.run(_drain(_cluster(other), placement))
    assert other.actor.aborts == ["req-1"]


async def _drain(c: Cluster, placement: Placement) -> None:
    async for _ in c.generate([1, 2, 3], SamplingParams(max_tokens=4), placement):
        pass


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_handoff_whose_prefill_worker_is_unreachable_falls_back_at_once(policy):
    """The prefill worker cannot be reached during a handoff: the decode worker prefills the
    prompt at once (a fallback, told to the request), or under --kv-failure-policy fail the
    request fails at once, while the abort on the prefill worker is tried on the supervisor
    loop until it answers: no wait for it in line."""
    from worker_protocol.messages import KVTarget

    class Decoder(Actor):
        def __init__(self) -> None:
            super().__init__()
            self.reserve_kv = SimpleNamespace(remote=self._reserve)
            self.finish_handoff = SimpleNamespace(
                options=lambda **_: SimpleNamespace(remote=self._finish)
            )
            self.finished: list[tuple] = []

        async def _reserve(self, req, peer, due):
            return KVTarget(req.request_id, (1, 2), 0, 0)

        def _finish(self, rid, first, logprobs):
            self.finished.append((rid, first))

            async def refs():
                yield _ready(TokenChunk(rid, (7, 8), True, "length"))

            return refs()

    class Prefiller(Actor):
        def __init__(self) -> None:
            super().__init__(*[unavailable()] * 1000)  # unreachable throughout
            self.prefill = SimpleNamespace(remote=self._prefill)

        async def _prefill(self, *args):
            raise unavailable()

    d = _handle("decode-0", Decoder())
    p = WorkerHandle("prefill-0", WorkerRole.PREFILL, Prefiller(), 0, status=WorkerStatus.READY)
    c = _cluster(d, p, timeout_s=1.0)
    c.config = c.handoffs.config = replace(c.config, kv_failure_policy=policy)
    c.pools.pairs = SimpleNamespace(connected=lambda a, b: True)
    fell: list[FallbackReason] = []
    listener = SimpleNamespace(
        fell_back=lambda reason, detail, wasted: fell.append(reason),
        prefilled=lambda result: None,
        replanned=lambda *a: None,
    )
    placement = Placement(
        path=RoutePath.DISAGGREGATED,
        request_id="req-2",
        prefill_worker="prefill-0",
        decode_worker="decode-0",
    )

    async def run() -> list[TokenChunk]:
        return [
            chunk
            async for chunk in c.generate(
                [1, 2, 3], SamplingParams(max_tokens=2), placement, listener
            )
        ]

    t0 = time.monotonic()
    if policy == "fail":
        with pytest.raises(HandoffFailed, match="prefill_failed"):
            asyncio.run(asyncio.wait_for(run(), 5))
        tried = 2  # as the handoff failed, and as the request did
    else:
        chunks = asyncio.run(asyncio.wait_for(run(), 5))
        assert [ch.token_ids for ch in chunks] == [(7, 8)]
        assert d.actor.finished == [("req-2", None)]
        tried = 1
    assert time.monotonic() - t0 < 0.5  # no wait for P, whose aborts go on later
    assert fell == [FallbackReason.PREFILL_FAILED] and p.active == d.active == 0
    assert p.actor.aborts == ["req-2"] * tried and len(c.submitted) == tried
    assert [asyncio.run(later) for later in c.submitted] == [False] * tried  # never answered
    assert len(p.actor.aborts) > 3 * tried
