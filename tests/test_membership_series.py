"""A worker that left its pool keeps no per-worker gauges, and `pdserve status` no row for it,
whatever load report of any of its incarnations comes after (router/membership.py); an id a
later scale-up takes again gets its series again. The membership and metrics objects driven
directly: no workers, no clock."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import generate_latest

from pdserve_client.metrics import parse
from router import status
from router.fake_backend import FakeBackend
from router.handoff_model import HandoffHealth
from router.membership import Membership
from router.metrics import Metrics
from worker_protocol.messages import WorkerInfo, WorkerLoad, WorkerRole

W = "decode-4"


class Replaced(FakeBackend):
    """decode-0 .. decode-4; what decode-4's id holds now is its `incarnation`."""

    incarnation = 0

    def __init__(self) -> None:
        super().__init__(num_prefill=1, num_decode=5)

    def worker_info(self, worker_id: str) -> WorkerInfo:
        info = super().worker_info(worker_id)
        return replace(info, incarnation=self.incarnation) if worker_id == W else info


def _load(incarnation: int) -> WorkerLoad:
    return WorkerLoad(W, WorkerRole.DECODE, 3, 2, 0, 0.5, 500, 1000, 40, incarnation=incarnation)


def _gauges(metrics: Metrics) -> set[str]:
    """The names of the gauges (counters keep their totals) with a series for W."""
    text = generate_latest(metrics.registry).decode()
    return {
        name
        for (name, labels) in parse(text)
        if dict(labels).get("worker") == W and not name.endswith("_total")
    }


def _row(metrics: Metrics) -> bool:
    """Whether `pdserve status` shows a row for W."""
    samples = parse(generate_latest(metrics.registry).decode())
    text = status.render(samples, samples, 1.0, "127.0.0.1:0")
    return any(line.split()[0] == W for line in text.splitlines() if line.strip())


@pytest.mark.parametrize("books_moved", [True, False], ids=["books-moved", "books-stayed"])
def test_a_late_report_of_any_incarnation_recreates_no_series_of_a_worker_gone(books_moved):
    """decode-4 (incarnation 0) reports, then dies; its replacement (incarnation 1) starts, and
    a resize removes it before it is up. With books_moved, a call for the id (a placement's step
    target) moved the books to the replacement before the poll that found the id gone, as a
    replacement that answered `ready` lets it. Reports of either incarnation that come after
    (a poll's answer in flight, the draining replacement's own) set no gauge again, however
    many polls follow. A scale-up that takes the id again gets its series, and loses them when
    it leaves in turn."""
    backend = Replaced()
    metrics = Metrics()
    infos = [backend.worker_info(w) for w in backend._ids()]
    m = Membership(backend, infos, HandoffHealth(), metrics)
    m.absorb([_load(0)])
    assert "pdserve_worker_requests_running" in _gauges(metrics) and _row(metrics)

    backend.decode_ids.remove(W)  # found dead: out of its pool; a replacement starts
    backend.incarnation = 1
    if books_moved:
        assert m.state(W).info.incarnation == 1
    m.absorb([])  # the poll that finds it gone
    assert _gauges(metrics) == set() and not _row(metrics)

    for late in (0, 1, 0, 1):  # the resize removed the replacement: the id stays out
        m.absorb([_load(late)])
        assert _gauges(metrics) == set(), late
        assert not _row(metrics), late
    m.absorb([])
    assert _gauges(metrics) == set() and not _row(metrics)

    backend.incarnation = 0  # a scale-up takes the id again: a new actor, incarnation 0
    backend.decode_ids.append(W)
    m.absorb([_load(0)])
    assert {
        "pdserve_worker_requests_running",
        "pdserve_worker_requests_waiting",
        "pdserve_worker_kv_cache_usage_ratio",
        "pdserve_worker_queued_prefill_tokens",
    } <= _gauges(metrics)
    assert _row(metrics)
    backend.decode_ids.remove(W)  # removed again
    m.absorb([_load(0)])
    assert _gauges(metrics) == set() and not _row(metrics)
