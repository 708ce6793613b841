"""Admission refusals reach the server's log: the first at once, then one line per window with
the counts, never a line per request."""

from __future__ import annotations

import logging

from router.metrics import Metrics
from router.refusal_log import RefusalLog
from router.vocab import Frontend, RejectReason

Q, RATE, LIMIT = RejectReason.QUEUE_FULL, RejectReason.DECODE_RATE, RejectReason.CLIENT_LIMIT
GRPC, HTTP = Frontend.GRPC, Frontend.HTTP


def lines(caplog) -> list[str]:
    out = [r.getMessage() for r in caplog.records if r.name == "pdserve.router"]
    caplog.clear()
    return out


def test_the_first_refusal_is_logged_at_once_then_one_line_per_window(caplog):
    caplog.set_level(logging.WARNING, "pdserve.router")
    rl = RefusalLog(window_s=10.0)
    rl.refused(Q, GRPC, now=100.0)
    [first] = lines(caplog)
    assert first.startswith("refusing requests (grpc): queue_full: too many requests wait")
    assert "--max-pending" in first and "pdserve_admission_rejections_total" in first
    for i in range(500):  # an overload: 500 refusals within the window, no line
        rl.refused(Q if i % 5 else RATE, HTTP if i % 2 else GRPC, now=100.0 + i * 0.01)
    assert lines(caplog) == []
    rl.refused(LIMIT, HTTP, now=110.0)  # the window is over: one line with every count
    [summary] = lines(caplog)
    assert summary.startswith("refused 501 requests in the last 10 s: ")
    assert "queue_full 200 (http)" in summary and "queue_full 200 (grpc)" in summary
    assert "decode_rate 50 (grpc)" in summary and "decode_rate 50 (http)" in summary
    assert "client_limit 1 (http)" in summary


def test_after_a_quiet_spell_a_refusal_is_logged_at_once_with_what_was_left(caplog):
    caplog.set_level(logging.WARNING, "pdserve.router")
    rl = RefusalLog(window_s=10.0)
    rl.refused(Q, GRPC, now=0.0)
    rl.refused(Q, GRPC, now=1.0)
    rl.refused(RATE, GRPC, now=2.0)
    lines(caplog)
    rl.refused(RejectReason.NO_WORKERS, HTTP, now=500.0)
    [line] = lines(caplog)
    assert line.startswith("refusing requests (http): no_workers: no worker that decodes is up")
    before = (
        "before: 2 requests over 2 s, up to 498 s ago: queue_full 1 (grpc), decode_rate 1 (grpc)"
    )
    assert before in line, line  # when they came, not the quiet since


def test_what_the_window_counted_is_said_as_the_server_stops(caplog):
    caplog.set_level(logging.WARNING, "pdserve.router")
    m = Metrics()
    m.refusals.refused(Q, GRPC, now=100.0)
    for _ in range(200):
        m.refusals.refused(RATE, HTTP, now=103.0)
    lines(caplog)
    m.close()
    [line] = lines(caplog)
    assert line.startswith("refused 200 requests over 3 s, up to "), line
    assert line.endswith("decode_rate 200 (http)")
    m.refusals.flush()  # nothing left
    assert lines(caplog) == []


def test_every_reason_is_explained():
    from router.refusal_log import WHY

    assert set(WHY) == set(RejectReason)


def test_the_servers_metrics_count_and_log_each_refusal(caplog):
    caplog.set_level(logging.WARNING, "pdserve.router")
    m = Metrics()
    m.rejected(RejectReason.SLO, Frontend.HTTP)
    sample = m.registry.get_sample_value(
        "pdserve_admission_rejections_total", {"reason": "slo", "frontend": "http"}
    )
    assert sample == 1
    [line] = lines(caplog)
    assert line.startswith("refusing requests (http): slo: its predicted TTFT misses its SLO")


def test_preemptions_a_worker_reports_are_counted_and_said_once_a_window(caplog):
    from worker_protocol.messages import WorkerLoad, WorkerRole

    caplog.set_level(logging.WARNING, "pdserve.pools")
    m = Metrics()

    def load(preemptions: int, incarnation: int = 0, wid: str = "decode-0") -> WorkerLoad:
        return WorkerLoad(
            wid, WorkerRole.DECODE, 4, 1, 0, 0.98, 2, 128, 0,
            preemptions=preemptions, incarnation=incarnation,
        )  # fmt: skip

    def said() -> list[str]:
        out = [r.getMessage() for r in caplog.records if r.name == "pdserve.pools"]
        caplog.clear()
        return out

    m.loads([load(0)])
    assert said() == []
    m.loads([load(3)])
    [line] = said()
    assert line.startswith("worker decode-0 preempted 3 requests: its KV cache was full")
    assert "--kv-cache-gib" in line and line.endswith("(3 such since the last line)")
    m.loads([load(5)])  # within the window: counted, not said
    m.loads([load(2, incarnation=1)])  # a new incarnation's own total
    assert said() == []
    total = m.registry.get_sample_value(
        "pdserve_worker_preemptions_total", {"worker": "decode-0", "role": "decode"}
    )
    assert total == 7
    assert m._preempted["decode-0"].since == 4
    # Another worker's are a line of its own, counted apart.
    m.loads([load(1, wid="decode-1")])
    [line] = said()
    assert line.startswith("worker decode-1 preempted 1 requests") and "(1 such" in line
