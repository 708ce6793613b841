"""The request core over a fake backend: admission, books, cancellation, the decision record."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import replace

import pytest

from engine.config import ModelConfig
from engine.loader import load_tokenizer
from engine.sampling_params import SamplingParams
from router.core import RequestCore
from router.core_types import Overloaded, RouterConfig
from router.fake_backend import FakeBackend
from router.placement_steps import KV_DUE_SHARE
from router.request import ParsedRequest
from router.vocab import FallbackReason, FinishReason, Frontend, Placement, RejectReason, RoutePath


def request(rid: str, n: int = 32, max_tokens: int = 4, slo_ttft_ms: float | None = None):
    return ParsedRequest(
        request_id=rid,
        prompt_token_ids=tuple(range(1, n + 1)),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        path=RoutePath.AUTO,
        slo_ttft_ms=slo_ttft_ms,
        slo_itl_ms=None,
        frontend=Frontend.GRPC,
    )


TOKENIZER = load_tokenizer(ModelConfig(model="tiny-llama"))


async def make_core(backend: FakeBackend, **config) -> RequestCore:
    core = RequestCore(backend, await backend.infos(), RouterConfig(**config), TOKENIZER)
    await core.refresh()
    return core


async def consume(core, req):
    return [c async for c in core.generate(req, asyncio.get_running_loop().time())]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def gaps_measured(core) -> None:
    """Serve one request of 60 tokens, then poll: the decode worker's gaps are measured, and the
    p99 gaps predicted from then on are checked as requests end (PathPrediction.itl_checkable)."""
    await consume(core, request("gaps", max_tokens=60))
    await core.refresh()


def test_a_full_queue_is_refused_at_once_and_frees_when_requests_move_on():
    async def main():
        gate = asyncio.Event()
        backend = FakeBackend(gate=gate)
        core = await make_core(backend, max_pending=2)
        waiting = [asyncio.ensure_future(consume(core, request(f"r{i}"))) for i in range(2)]
        await asyncio.sleep(0.05)
        assert core.pending == 2
        with pytest.raises(Overloaded) as err:
            await consume(core, request("r2"))
        assert err.value.reason is RejectReason.QUEUE_FULL and err.value.retry_after_s > 0
        # No work was done for it (workers see internal ids: the client's id, '#', a number).
        assert not [w for w in backend.started if w.startswith("r2#")]
        gate.set()
        outs = await asyncio.gather(*waiting)
        assert [sum(len(c.token_ids) for c in o) for o in outs] == [4, 4]
        assert core.pending == core.active == 0
        assert len(await consume(core, request("r3"))) == 4  # admitted again
        # The decode demand (router/capacity.py) counts the three taken, not the one refused,
        # and the tokens each decoded.
        demand = core.planner.demand
        assert [a[1] for a in demand._arrivals] == [32] * 3
        assert list(demand._outputs) == [(4, 4)] * 3 and demand.output_len() == 4

    run(main())


def test_predicted_ttft_past_the_slo_is_refused_only_when_waiting_would_help():
    async def main():
        gate = asyncio.Event()
        backend = FakeBackend(num_prefill=0, gate=gate)  # one place to run: one queue
        core = await make_core(backend)
        # Idle workers: even a hopeless SLO is served (a retry could not do better).
        first = asyncio.ensure_future(consume(core, request("big", n=3000, slo_ttft_ms=1)))
        await asyncio.sleep(0.05)
        # Now the big prompt is queued ahead: a tight SLO is refused with a retry hint.
        with pytest.raises(Overloaded) as err:
            await consume(core, request("late", n=64, slo_ttft_ms=1))
        assert err.value.reason is RejectReason.SLO and err.value.retry_after_s > 0
        assert "exceeds the TTFT SLO" in str(err.value)
        gate.set()
        assert len(await first) == 4
        assert core.pending == core.active == 0

    run(main())


def test_requests_past_the_rate_the_decodes_hold_are_refused_with_no_work_done():
    """Requests of 2000 tokens taken at 20 req/s over the last 10 s: the decode worker's steady
    state at that rate passes an ITL SLO that a lone request's gaps hold, and it runs as many
    decodes as it holds within it. A request with that SLO is refused (decode_rate, with a retry
    hint), no work done for it, nothing left counted; with --no-decode-rate-admission it is
    served. One whose SLO even a lone request's gaps miss is served: refusing it would not help
    it."""

    async def main(admission: bool):
        backend = FakeBackend()
        core = await make_core(backend, decode_rate_admission=admission)
        demand = core.planner.demand
        now = time.monotonic()
        for i in range(200):
            demand.arrived(32, 2000, now=now - 10 + i * 0.05)
        d = core.states["decode-0"]
        idle = demand.p99_gap(d, 0.0, 1.0, 32)
        steady = demand.p99_gap(d, 20.1, demand.output_len(), demand.context())
        assert steady > 2 * idle
        slo = min(4 * idle, math.sqrt(idle * steady))
        # The decodes running there are as many as it holds within the SLO.
        room = demand.holds(d, slo, demand.context())
        assert room > 0
        for i in range(room):
            d.add_decode(f"running-{i}", 1000, slo, local=False)
        late = replace(request("late"), slo_itl_ms=slo * 1000)
        if admission:
            with pytest.raises(Overloaded) as err:
                await consume(core, late)
            assert err.value.reason is RejectReason.DECODE_RATE
            # Come back as a decode ends there, room of them running: slower than they came.
            from router.capacity import _gap

            ends = room / (demand.output_len() * _gap(d, room, demand.context(), 1.0))
            assert ends < 20.1 / 2
            assert err.value.retry_after_s == pytest.approx(1 / ends, rel=0.05)
            assert f"past the ITL SLO {slo * 1000:.0f} ms" in str(err.value)
            # The next ones refused are told a slot later each: a burst's retries spread out.
            from router.admission import RetrySpread

            frozen = time.monotonic()
            core.spread = RetrySpread(clock=lambda: frozen)
            hints = []
            for i in range(3):
                with pytest.raises(Overloaded) as err:
                    await consume(core, replace(late, request_id=f"late-{i}"))
                hints.append(err.value.retry_after_s)
            assert hints == pytest.approx([k / ends for k in (1, 2, 3)], rel=0.05)
            # Five decodes placed beyond what it holds end before the next one refused.
            for i in range(5):
                d.add_decode(f"beyond-{i}", 1000, slo, local=False)
            core.spread = RetrySpread(clock=lambda: frozen)
            with pytest.raises(Overloaded) as err:
                await consume(core, replace(late, request_id="late-after"))
            assert err.value.retry_after_s == pytest.approx(6 / ends, rel=0.05)
            assert not [w for w in backend.started if w.startswith("late")]
        else:
            assert len(await consume(core, late)) == 4
        hopeless = replace(request("hopeless"), slo_itl_ms=idle / 2 * 1000)
        assert len(await consume(core, hopeless)) == 4
        assert core.pending == core.active == 0

    run(main(True))
    run(main(False))


def test_leaving_early_closes_the_backend_stream_and_the_books():
    async def main():
        backend = FakeBackend()
        core = await make_core(backend)
        stream = core.generate(request("c", max_tokens=100), 0.0)
        got = [await stream.__anext__() for _ in range(3)]
        assert sum(len(c.token_ids) for c in got) == 3
        await stream.aclose()
        assert [w.split("#")[0] for w in backend.closed] == ["c"]
        assert core.pending == core.active == 0
        d = core.states["decode-0"]
        assert d.batch == 0 and d.queued_tokens == 0

    run(main())


def test_every_decision_is_recorded_with_its_measured_ttft():
    async def main():
        backend = FakeBackend(num_prefill=1, num_decode=2)
        core = await make_core(backend)
        for i in range(6):
            chunks = await consume(core, request(f"q{i}", n=16 + 40 * i))
            final = chunks[-1].final
            assert final is not None and final.completion_tokens == 4
            assert final.decision.reason and final.ttft_s >= 0
        assert [r.request_id for r in core.records] == [f"q{i}" for i in range(6)]
        assert all(r.measured_ttft_s is not None for r in core.records)
        assert core.prediction_error() is not None

    run(main())


def test_a_request_past_its_ttft_slo_no_longer_guards_the_itl_of_its_worker():
    async def main():
        gate = asyncio.Event()
        backend = FakeBackend(num_prefill=0, gate=gate)
        core = await make_core(backend, slo_itl_s=0.2)
        d = core.states["decode-0"]
        now = asyncio.get_running_loop().time()
        lost = core.generate(request("lost", max_tokens=50, slo_ttft_ms=1), now)
        kept = core.generate(request("kept", max_tokens=50, slo_ttft_ms=60_000), now)
        first_lost = asyncio.ensure_future(lost.__anext__())
        await asyncio.sleep(0.02)  # past the 1 ms SLO before its first token
        gate.set()
        await first_lost
        assert d.batch == 1 and d.min_itl_slo_s == float("inf")  # it cannot attain any more
        await kept.__anext__()
        assert d.batch == 2 and d.min_itl_slo_s == pytest.approx(0.2)  # this one still can
        await lost.aclose()
        await kept.aclose()
        assert d.batch == 0

    run(main())


def test_a_fallback_is_counted_by_reason_and_said_in_the_summary():
    from router.metrics import Metrics
    from router.vocab import FallbackReason

    async def main():
        backend = FakeBackend(fallback=FallbackReason.PAIRING_FAILED)
        metrics = Metrics()
        core = RequestCore(backend, await backend.infos(), RouterConfig(), TOKENIZER, metrics)
        await core.refresh()
        dis = replace(request("dis"), path=RoutePath.DISAGGREGATED)
        colo = replace(request("colo"), path=RoutePath.COLOCATED)
        (last_dis, last_colo) = [(await consume(core, r))[-1].final for r in (dis, colo)]
        return metrics, core, last_dis, last_colo

    metrics, core, dis, colo = run(main())
    assert dis.path is RoutePath.DISAGGREGATED  # the path chosen stays what it was
    assert dis.kv_fallback is FallbackReason.PAIRING_FAILED
    assert colo.kv_fallback is None
    sample = metrics.registry.get_sample_value
    assert sample("pdserve_local_prefill_fallbacks_total", {"reason": "pairing_failed"}) == 1
    for other in FallbackReason:  # the others exist at 0, so their first one is an increase
        if other is not FallbackReason.PAIRING_FAILED:
            assert sample("pdserve_local_prefill_fallbacks_total", {"reason": other.value}) == 0
    # The pair's failure is learned: auto stops choosing it while it keeps failing.
    assert core.health.failure_rate("prefill-0", "decode-0") == pytest.approx(0.5, abs=0.01)


def test_a_decode_worker_without_room_to_reserve_does_not_count_against_its_pair():
    """A handoff that falls back because the decode worker had no blocks or slot to reserve (or,
    a worker that does both, none within its share) says nothing of the pair's health."""
    from router.vocab import FallbackReason

    async def main():
        core = await make_core(FakeBackend(fallback=FallbackReason.NO_RESERVATION))
        final = (await consume(core, replace(request("dis"), path=RoutePath.DISAGGREGATED)))[-1]
        return core, final.final

    core, final = run(main())
    assert final.kv_fallback is FallbackReason.NO_RESERVATION  # it did fall back
    assert core.health.failure_rate("prefill-0", "decode-0") == 0.0


def test_admission_judges_a_prediction_by_how_late_first_tokens_have_come():
    async def main():
        gate = asyncio.Event()
        backend = FakeBackend(num_prefill=0, gate=gate)  # one place to run: one queue
        core = await make_core(backend)
        first = asyncio.ensure_future(consume(core, request("big", n=3000)))
        await asyncio.sleep(0.05)
        _, decision = core.plan(request("probe", n=64))
        assert decision.chosen.queue_s > 0
        slo_ms = decision.chosen.ttft_s * 2000  # twice the bare prediction
        core.planner.ttft_margin = (
            3.0  # first tokens have lately come three times later than predicted
        )
        with pytest.raises(Overloaded) as err:
            await consume(core, request("late", n=64, slo_ttft_ms=slo_ms))
        assert err.value.reason is RejectReason.SLO and "x 3.00" in str(err.value)
        core.planner.ttft_margin = 1.5
        admitted = asyncio.ensure_future(consume(core, request("ok", n=64, slo_ttft_ms=slo_ms)))
        gate.set()
        assert len(await first) == 4 and len(await admitted) == 4
        assert core.pending == core.active == 0

    run(main())


def test_a_replanned_prefill_is_counted_and_the_summary_names_the_worker_that_did_it():
    from router.metrics import Metrics

    async def main():
        backend = FakeBackend(num_prefill=2, replan=True)
        metrics = Metrics()
        core = RequestCore(backend, await backend.infos(), RouterConfig(), TOKENIZER, metrics)
        await core.refresh()
        final = (await consume(core, replace(request("r"), path=RoutePath.DISAGGREGATED)))[-1]
        return metrics, core, final.final

    metrics, core, final = run(main())
    chosen = core.records[-1].decision.chosen.prefill_worker
    assert final.prefill_worker not in (chosen, None) and final.kv_fallback is None
    assert metrics.registry.get_sample_value("pdserve_prefill_replans_total") == 1
    assert core.health.failure_rate(chosen, "decode-0") > 0  # the dead one's pair learned it
    assert core.records[-1].disturbed  # and the admission margin leaves it out


def test_a_request_resumes_on_another_worker_than_the_one_lost_while_another_can_decode_it():
    """A lost worker may still be in its pool (unreachable for now, and may come back): the
    resume is planned without it, unless it is the only one that decodes."""

    async def main(num_decode: int) -> list[str | None]:
        backend = FakeBackend(num_decode=num_decode, lose_decode_after=3)
        core = RequestCore(backend, await backend.infos(), RouterConfig(), TOKENIZER)
        await core.refresh()
        chunks = await consume(core, request("moved", max_tokens=8))
        assert sum(len(c.token_ids) for c in chunks) == 8 and core.resumed == 1
        final = chunks[-1].final
        assert final is not None and final.resumed == 1
        assert final.decode_worker == backend.placements[-1].decode_worker  # where it ended
        # The resume asks for what is left, past the samples drawn for the 3 tokens it had.
        assert [(s.max_tokens, s.drawn) for s in backend.sampling] == [(8, 0), (5, 3)]
        return [p.decode_worker for p in backend.placements]

    first, again = run(main(2))
    assert first is not None and again is not None and again != first
    assert run(main(1)) == ["decode-0", "decode-0"]


def test_requests_go_to_workers_that_answer_their_polls_while_one_does():
    """A worker silent for a while (Backend.silent: not yet taken for hung) takes no new
    request, prefill or decode, while another can decode it; where none answers, the pools
    are used as they are rather than refusing."""

    async def main(silent: set[str]) -> list[tuple[str | None, str | None]]:
        backend = FakeBackend(num_prefill=1, num_decode=2)
        backend.silent = silent
        core = await make_core(backend)
        for i in range(4):
            req = replace(request(f"r{i}", n=32 + 8 * i), path=RoutePath.DISAGGREGATED)
            await consume(core, req)
        return [(p.prefill_worker, p.decode_worker) for p in backend.placements]

    assert run(main(set())) == [("prefill-0", "decode-0")] * 4  # where they go otherwise
    assert run(main({"decode-0"})) == [("prefill-0", "decode-1")] * 4
    # Disaggregated asked, but the one prefill worker is silent: prefilled where decoded.
    assert run(main({"decode-0", "prefill-0"})) == [(None, "decode-1")] * 4
    assert run(main({"decode-0", "decode-1"})) == [("prefill-0", "decode-0")] * 4  # as it is


def test_a_request_whose_decode_worker_dies_resumes_and_its_books_settle_once():
    from router.metrics import Metrics

    async def main():
        backend = FakeBackend(num_decode=2, lose_decode_after=3)
        metrics = Metrics()
        core = RequestCore(backend, await backend.infos(), RouterConfig(), TOKENIZER, metrics)
        await core.refresh()
        chunks, mid = [], []
        async for chunk in core.generate(request("moved", max_tokens=8), 0.0):
            chunks.append(chunk)
            if len(backend.started) == 2 and chunk.final is None:  # placed again, streaming
                mid.append(metrics.registry.get_sample_value("pdserve_requests_resumed_total"))
        return metrics, core, backend, chunks, mid

    metrics, core, backend, chunks, mid = run(main())
    assert mid and set(mid) == {1}  # counted as it moved, not once it ended
    assert sum(len(c.token_ids) for c in chunks) == 8  # 3 before the loss, 5 after
    final = chunks[-1].final
    assert final is not None and final.finish_reason is FinishReason.LENGTH
    assert final.completion_tokens == 8
    assert len(backend.lost) == 1 and len(backend.started) == 2  # placed twice
    assert core.resumed == 1 and core.pending == core.active == 0
    assert all(s.batch == 0 and s.queued_tokens == 0 for s in core.states.values())
    # 8 tokens, 7 gaps; the one across the resume is charged to no worker's gap tail.
    assert sum(len(s.measured.recent_gaps(0.0)) for s in core.states.values()) == 6
    sample = metrics.registry.get_sample_value
    assert sample("pdserve_requests_resumed_total") == 1
    done = {"path": final.path.value, "finish_reason": "length", "frontend": "grpc"}
    assert sample("pdserve_requests_total", done) == 1  # one record, not one per placement
    assert sample(
        "pdserve_time_to_first_token_seconds_count", {"path": final.path.value, "frontend": "grpc"}
    ) == 1  # fmt: skip
    assert [r.request_id for r in core.records] == ["moved"]
    # The decode demand books what it decoded against what it asked for at first (8 of 8), not
    # against the 5 left when it resumed.
    assert list(core.planner.demand._outputs) == [(8, 8)]


def test_requests_and_ttft_are_counted_by_front_door():
    from router.metrics import Metrics

    async def main():
        backend = FakeBackend()
        metrics = Metrics()
        core = RequestCore(backend, await backend.infos(), RouterConfig(), TOKENIZER, metrics)
        await core.refresh()
        colo = replace(request("h"), path=RoutePath.COLOCATED, frontend=Frontend.HTTP)
        await consume(core, colo)
        stream = core.generate(replace(colo, request_id="left"), 0.0)
        await stream.__anext__()
        await stream.aclose()  # the client left: an abort, not an error
        return metrics

    sample = run(main()).registry.get_sample_value
    by = {"path": "colocated", "frontend": "http"}
    assert sample("pdserve_requests_total", {**by, "finish_reason": "length"}) == 1
    assert sample("pdserve_requests_total", {**by, "finish_reason": "abort"}) == 1
    assert sample("pdserve_time_to_first_token_seconds_count", by) == 2
    assert sample("pdserve_time_to_first_token_seconds_count", {**by, "frontend": "grpc"}) is None


def test_a_refusal_is_counted_by_its_reason():
    from router.metrics import Metrics

    async def main():
        backend = FakeBackend(gate=asyncio.Event())
        metrics = Metrics()
        config = RouterConfig(max_pending=0)
        core = RequestCore(backend, await backend.infos(), config, TOKENIZER, metrics)
        await core.refresh()
        with pytest.raises(Overloaded) as err:
            await consume(core, request("no"))
        assert err.value.reason is RejectReason.QUEUE_FULL
        return metrics

    sample = run(main()).registry.get_sample_value
    by = {"reason": "queue_full", "frontend": "grpc"}
    assert sample("pdserve_admission_rejections_total", by) == 1
    for other in RejectReason:  # every reason exists at 0 from the start, for both doors
        for door in ("grpc", "http"):
            if (other.value, door) != ("queue_full", "grpc"):
                labels = {"reason": other.value, "frontend": door}
                assert sample("pdserve_admission_rejections_total", labels) == 0


def test_a_handoff_tells_its_decode_worker_how_soon_its_kv_may_land():
    """A disaggregated placement carries KV_DUE_SHARE of its predicted TTFT (the models' alone
    where a pair's failure risk raised it; the decode worker runs its own prompts whole until
    then); a colocated one, none, and a placement refuses a due time it could not keep."""

    async def main():
        backend = FakeBackend(num_prefill=1, num_decode=1)
        core = await make_core(backend)
        for path in (RoutePath.DISAGGREGATED, RoutePath.COLOCATED):
            await consume(core, replace(request(path.value, n=400), path=path))
            placed, chosen = backend.placements[-1], core.records[-1].decision.chosen
            assert placed.path is chosen.path is path
            if path is RoutePath.DISAGGREGATED:
                assert chosen.ttft_s > 0
                due = KV_DUE_SHARE * min(chosen.ttft_s, chosen.raw_ttft_s)
                assert placed.kv_due_in_s == pytest.approx(due) and due > 0
            else:
                assert placed.kv_due_in_s == 0.0
        for bad in (-1.0, float("inf"), float("nan")):
            with pytest.raises(ValueError, match="kv_due_in_s"):
                Placement(path=RoutePath.DISAGGREGATED, kv_due_in_s=bad)
        with pytest.raises(ValueError, match="kv_due_in_s"):
            Placement(path=RoutePath.COLOCATED, kv_due_in_s=1.0)

    run(main())


def test_a_placement_carries_its_prompts_hold_from_its_ttft_slo():
    """With a hold share (`--prefill-hold-ms auto`) each placement tells the worker how long its
    prompt may wait for decodes there: that share of its own TTFT SLO, or of the default; none
    without a share (the worker's own hold). A request resumed after it streamed tokens may not
    wait at all: a wait would be a gap in its stream."""

    async def main():
        backend = FakeBackend(num_decode=2)
        core = await make_core(backend, prefill_hold_share=0.5, slo_ttft_s=12.0)
        await consume(core, request("own", slo_ttft_ms=3000))
        await consume(core, request("default"))
        assert [p.prefill_hold_s for p in backend.placements] == [1.5, 6.0]
        plain = FakeBackend(num_decode=2)
        await consume(await make_core(plain), request("none", slo_ttft_ms=3000))
        assert plain.placements[-1].prefill_hold_s is None
        for share, want in ((0.5, 1.5), (None, None)):  # auto, and a worker's own hold
            moved = FakeBackend(num_decode=2, lose_decode_after=3)
            core = await make_core(moved, prefill_hold_share=share)
            await consume(core, request("moved", max_tokens=8, slo_ttft_ms=3000))
            assert core.resumed == 1
            assert [p.prefill_hold_s for p in moved.placements] == [want, 0.0]
        # Lost before its first token: it may still wait, what its first placement took less.
        early = FakeBackend(num_decode=2, lose_decode_after=0)
        core = await make_core(early, prefill_hold_share=0.5)
        await consume(core, request("early", max_tokens=8, slo_ttft_ms=3000))
        first, again = (p.prefill_hold_s for p in early.placements)
        assert core.resumed == 1 and first == 1.5 and again is not None and 1.0 < again < 1.5
        for bad in (-1.0, float("inf"), float("nan")):
            with pytest.raises(ValueError, match="prefill_hold_s"):
                Placement(path=RoutePath.COLOCATED, prefill_hold_s=bad)
        with pytest.raises(ValueError, match="prefill_hold_share"):
            RouterConfig(prefill_hold_share=1.5)

    run(main())


def test_a_placement_takes_a_path_that_is_taken():
    assert Placement(path=RoutePath.DISAGGREGATED, request_id="x").prefill_worker is None
    a, b = Placement(path=RoutePath.COLOCATED), Placement(path=RoutePath.COLOCATED)
    assert a.request_id != b.request_id and a.decode_worker is None
    assert Placement(path="colocated").path is RoutePath.COLOCATED  # type: ignore[arg-type]
    for bad in (RoutePath.AUTO, "auto", "colocate"):
        with pytest.raises(ValueError):
            Placement(path=bad)  # type: ignore[arg-type]


def test_workers_of_both_kinds_are_counted_once_by_their_role_and_serve_both_paths():
    from router.metrics import Metrics

    async def main():
        backend = FakeBackend(num_prefill=0, num_decode=0, num_both=2)
        metrics = Metrics()
        core = RequestCore(backend, await backend.infos(), RouterConfig(), TOKENIZER, metrics)
        await core.refresh()
        finals = []
        for path in (RoutePath.COLOCATED, RoutePath.DISAGGREGATED, RoutePath.AUTO):
            finals.append((await consume(core, replace(request(path.value), path=path)))[-1])
        return metrics, finals

    metrics, finals = run(main())
    sample = metrics.registry.get_sample_value
    got = {r: sample("pdserve_workers", {"role": r}) for r in ("prefill", "decode", "both")}
    assert got == {"prefill": 0, "decode": 0, "both": 2}
    colo, dis, auto = (c.final for c in finals)
    assert colo.path is RoutePath.COLOCATED and dis.path is RoutePath.DISAGGREGATED
    assert dis.prefill_worker and dis.prefill_worker != dis.decode_worker
    # Each worker counts the prefills placed on it, for a peer or local; and its decodes.
    placed = {
        (w, kind): sample(
            "pdserve_worker_prefills_total", {"worker": w, "role": "both", "kind": kind}
        )
        or 0
        for w in ("both-0", "both-1")
        for kind in ("for_peer", "local")
    }
    local = 1 + (auto.path is RoutePath.COLOCATED)
    assert sum(v for (w, k), v in placed.items() if k == "local") == local
    assert sum(v for (w, k), v in placed.items() if k == "for_peer") == 3 - local
    assert placed[(dis.prefill_worker, "for_peer")] >= 1
    for w in ("both-0", "both-1"):
        assert sample("pdserve_worker_decodes_running", {"worker": w, "role": "both"}) == 0


def test_a_request_that_ends_tells_its_decode_worker_its_own_tail():
    async def main():
        core = await make_core(FakeBackend(chunk_tokens=1))
        await consume(core, replace(request("long", max_tokens=20), path=RoutePath.COLOCATED))
        await consume(core, replace(request("short", max_tokens=5), path=RoutePath.COLOCATED))
        return core

    core = run(main())
    tails = [r for w in core.states.values() for _, r in w.measured._request_tails]
    assert len(tails) == 1 and tails[0] >= 1.0  # 19 gaps; the 4 of the short one say too little


def test_ended_requests_teach_the_spread_of_the_predictions_near_their_slo():
    """Each first token trains how far TTFT predictions come from measured ones, each ended
    request how far its decode worker's predicted p99 gap came from its measured one, where it
    was predicted with the worker's gaps measured (a first request's, predicted without them,
    teaches none): each against its own SLO (here 10 us, which any measurement passes), not far
    under it."""
    import numpy as np

    from router.stats import NullSink

    class Ended(NullSink):
        def __init__(self):
            self.records = []

        def finished(self, record):
            self.records.append(record)

    sink = Ended()

    async def main():
        backend = FakeBackend(chunk_tokens=1)
        core = RequestCore(backend, await backend.infos(), RouterConfig(), TOKENIZER, sink=sink)
        await core.refresh()
        await consume(core, request("ttft", max_tokens=20, slo_ttft_ms=0.01))
        # Predicted before any gaps were measured there: it teaches no spread.
        await consume(core, replace(request("cold", max_tokens=20), slo_itl_ms=0.01))
        assert sum(w.measured.itl_spread.samples for w in core.states.values()) == 0
        await gaps_measured(core)
        await consume(core, replace(request("itl", max_tokens=20), slo_itl_ms=0.01))
        await consume(core, request("loose", max_tokens=20))  # default SLOs: far under them
        return core

    core = run(main())
    ttft, _, _, itl, _ = core.records
    spread = core.planner.ttft_spread
    assert spread.samples == 1
    measured, predicted = ttft.measured_ttft_s, ttft.decision.chosen.ttft_s
    assert spread._errors[0] == pytest.approx(abs(np.log(measured / predicted)))
    d = core.states[itl.decision.chosen.decode_worker]
    assert (
        sum(w.measured.itl_spread.samples for w in core.states.values())
        == d.measured.itl_spread.samples
        == 1
    )
    gaps = next(r.itl_s for r in sink.records if r.request_id == "itl")
    p99 = np.percentile(gaps, 99)
    assert d.measured.itl_spread._errors[0] == pytest.approx(
        abs(np.log(p99 / itl.decision.chosen.itl_p99_s))
    )


def test_a_resumed_request_teaches_no_spread_its_gaps_across_two_workers():
    """Its gaps came from two decode workers and a resume: neither worker's spread learns them,
    though both workers' gaps were measured when it was placed (its prediction one to check)."""

    async def main():
        backend = FakeBackend(num_decode=2, lose_decode_after=3)
        core = RequestCore(backend, await backend.infos(), RouterConfig(), TOKENIZER)
        await core.refresh()
        for w in core.states.values():
            w.measured.observe_gaps([0.001] * 60)
            w.measured.update_tail()
        await consume(core, replace(request("moved", max_tokens=30), slo_itl_ms=0.01))
        return core

    core = run(main())
    assert core.resumed == 1
    assert core.records[-1].decision.chosen.itl_checkable
    assert sum(w.measured.itl_spread.samples for w in core.states.values()) == 0


def test_a_colocated_request_waiting_for_its_prefill_is_a_decode_to_come_on_its_worker():
    """Before its first token it is not decoding yet, but prefills placed after it on its worker
    run their chunks beside its decode: its ITL SLO is at risk from them from its placement on."""

    async def main():
        gate = asyncio.Event()
        backend = FakeBackend(num_prefill=0, gate=gate)
        core = await make_core(backend)
        d = core.states["decode-0"]
        now = asyncio.get_running_loop().time()
        stream = core.generate(
            replace(request("colo", max_tokens=20), path=RoutePath.COLOCATED, slo_itl_ms=150),
            now,
        )
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.02)
        assert d.batch == 0 and d.coming_itl_slos() == [pytest.approx(0.15)]
        gate.set()
        await first
        assert d.coming_itl_slos() == [] and d.itl_slos() == [pytest.approx(0.15)]
        await stream.aclose()
        assert d.batch == 0 and d.coming_itl_slos() == [] and not d.busy

    run(main())


def test_the_spreads_of_the_predictions_are_exported_per_kind_and_decode_worker():
    from router.metrics import Metrics
    from router.spread import PRIOR_WIDTH

    async def main():
        backend = FakeBackend(chunk_tokens=1)
        metrics = Metrics()
        core = RequestCore(backend, await backend.infos(), RouterConfig(), TOKENIZER, metrics)
        await core.refresh()
        sample = metrics.registry.get_sample_value
        before = sample("pdserve_prediction_spread", {"kind": "ttft", "worker": ""})
        await gaps_measured(core)
        await consume(core, replace(request("itl", max_tokens=20), slo_itl_ms=0.01))
        await consume(core, request("ttft", max_tokens=20, slo_ttft_ms=0.01))
        await core.refresh()
        return core, sample, before

    core, sample, before = run(main())
    assert before == PRIOR_WIDTH  # nothing checked yet
    ttft = sample("pdserve_prediction_spread", {"kind": "ttft", "worker": ""})
    assert ttft == core.planner.ttft_spread.width and core.planner.ttft_spread.samples == 1
    d = core.states["decode-0"]
    assert d.measured.itl_spread.samples == 1
    got = sample("pdserve_prediction_spread", {"kind": "itl_p99", "worker": "decode-0"})
    assert got == d.measured.itl_spread.width != PRIOR_WIDTH
    assert sample("pdserve_prediction_spread", {"kind": "itl_p99", "worker": "prefill-0"}) is None


def test_each_kind_of_placement_teaches_its_own_bias_on_its_decode_worker():
    """A request that prefilled on its decode worker teaches that worker's colocated bias, one
    whose KV came from the prefill worker its received bias, each from the p99 gap predicted
    before any bias; one whose handoff fell back teaches neither. After five of a kind the
    factor moves; a kind with fewer takes the worker's, over all its checked requests; the
    metrics export each per kind and worker."""
    import numpy as np

    from router.metrics import Metrics
    from router.spread import MAX_BIAS
    from router.vocab import FallbackReason

    class Ended(Metrics):
        def __init__(self):
            super().__init__()
            self.records = []

        def finished(self, record):
            super().finished(record)
            self.records.append(record)

    async def main(backend, sink, lose_after=None):
        core = RequestCore(backend, await backend.infos(), RouterConfig(), TOKENIZER, sink)
        await core.refresh()
        await gaps_measured(core)
        backend.lose_decode_after = lose_after
        for i, path in enumerate([RoutePath.COLOCATED] * 5 + [RoutePath.DISAGGREGATED] * 2):
            await consume(core, replace(request(f"r{i}", max_tokens=20), path=path))
        await core.refresh()
        return core

    sink = Ended()
    core = run(main(FakeBackend(chunk_tokens=1), sink))
    d = core.states["decode-0"]
    assert d.measured.itl_bias[True].samples == 5 and d.measured.itl_bias[False].samples == 2
    assert core.states["prefill-0"].measured.itl_bias[True].samples == 0
    placed = [r for r in core.records if r.request_id != "gaps"]
    colocated = [r for r in placed if r.decision.chosen.path is RoutePath.COLOCATED]
    errors = [e for _, e in d.measured.itl_bias[True]._errors]
    for r, e in zip(colocated, errors, strict=True):
        gaps = next(x.itl_s for x in sink.records if x.request_id == r.request_id)
        assert r.decision.chosen.itl_bias == 1.0  # none yet at its placement
        assert e == pytest.approx(np.log(np.percentile(gaps, 99) / r.decision.chosen.raw_itl_p99_s))
    # The fake backend's gaps are far under any prediction: the factor stops at its bound.
    factor = min(MAX_BIAS, max(1 / MAX_BIAS, float(np.exp(np.median(errors)))))
    assert d.measured.itl_bias_factor(local=True) == pytest.approx(factor) != 1.0
    # Two are too few: the received kind takes the worker's, over all seven.
    both = errors + [e for _, e in d.measured.itl_bias[False]._errors]
    pooled = min(MAX_BIAS, max(1 / MAX_BIAS, float(np.exp(np.median(both)))))
    assert d.measured.itl_bias_factor(local=False) == pytest.approx(pooled) != 1.0
    sample = sink.registry.get_sample_value
    labels = {"kind": "colocated", "worker": "decode-0"}
    assert sample("pdserve_prediction_bias_ratio", labels) == pytest.approx(factor)
    received = sample("pdserve_prediction_bias_ratio", {**labels, "kind": "received"})
    assert received == pytest.approx(pooled)

    fell_back = run(main(FakeBackend(fallback=FallbackReason.TRANSFER_FAILED), Ended()))
    assert (
        sum(fell_back.states["decode-0"].measured.itl_bias[k].samples for k in (True, False)) == 5
    )
    # A handoff re-planned onto another prefill worker teaches neither kind, nor does a
    # request that resumed on another decode worker after losing its own.
    replanned = run(main(FakeBackend(num_prefill=2, replan=True), Ended()))
    d = replanned.states["decode-0"]
    assert (d.measured.itl_bias[True].samples, d.measured.itl_bias[False].samples) == (5, 0)
    assert sum(r.disturbed for r in replanned.records) == 2
    lost, ended = FakeBackend(num_decode=2), Ended()
    resumed = run(main(lost, ended, lose_after=5))
    assert len(lost.lost) == 1 and sum(r.resumed for r in ended.records) == 1
    checked = {r.request_id for r in resumed.records if r.decision.chosen.itl_checkable}
    assert {rid.split("#")[0] for rid in lost.lost} <= checked  # it would have taught
    taught = sum(
        w.measured.itl_bias[k].samples for w in resumed.states.values() for k in (True, False)
    )
    assert taught == len(checked) - 1


def test_a_decoding_request_is_priced_with_the_bias_of_its_kind_of_placement():
    """On a decode worker whose colocated requests came at 2x their predicted p99 gap and whose
    received ones at 3x, a colocated request decoding there (from its first token) is checked
    at 2x in the misses new work would cause, a handoff (from its placement) at 3x."""
    from router.metrics import Metrics
    from router.worker_books import ItlCheck

    async def main():
        backend = FakeBackend(chunk_tokens=1)
        core = RequestCore(backend, await backend.infos(), RouterConfig(), TOKENIZER, Metrics())
        await core.refresh()
        d = core.states["decode-0"]
        for _ in range(5):
            d.measured.itl_bias[True].observe(0.05, 0.10)
            d.measured.itl_bias[False].observe(0.05, 0.15)
        d.measured.update_tail()
        seen = {}
        for path in (RoutePath.COLOCATED, RoutePath.DISAGGREGATED):
            req = replace(request(path.value, max_tokens=20), path=path)
            stream = core.generate(req, asyncio.get_running_loop().time())
            first = await anext(stream)
            assert first.token_ids
            seen[path] = d.itl_checks()
            rest = [c async for c in stream]
            assert sum(len(c.token_ids) for c in rest) == 19
        return seen, d

    seen, d = run(main())
    slo = RouterConfig().slo_itl_s
    assert seen[RoutePath.COLOCATED] == [ItlCheck(pytest.approx(slo), pytest.approx(2.0))]
    assert seen[RoutePath.DISAGGREGATED] == [ItlCheck(pytest.approx(slo), pytest.approx(3.0))]
    assert d.itl_checks() == []


def test_ending_every_stream_answers_each_with_shutting_down_and_settles_the_books():
    """The server stopping (router/endings.py): a stream waiting for its next chunk ends at
    once, one whose reader holds a chunk ends when it asks for the next; each raises
    ShuttingDown (not a cancellation), and the books are settled."""
    from router.errors import ShuttingDown, failure_reason
    from router.vocab import FailureReason

    async def main():
        gate = asyncio.Event()
        gate.set()
        backend = FakeBackend(gate=gate)
        core = await make_core(backend)
        held = core.generate(request("held", max_tokens=50), time.monotonic())
        first = await anext(held)  # its reader holds this chunk
        gate.clear()
        waiting = asyncio.ensure_future(consume(core, request("waiting")))
        await asyncio.sleep(0.05)
        assert core.active == 2 and len(core.endings.live) == 2
        assert core.endings.end_all("the server is shutting down: a test") == 2
        with pytest.raises(ShuttingDown, match="a test") as err:
            await waiting
        assert failure_reason(err.value) is FailureReason.SHUTTING_DOWN
        assert waiting.cancelling() == 0  # the cancellation was taken back
        assert first.token_ids
        with pytest.raises(ShuttingDown):
            await anext(held)
        assert core.active == core.pending == 0 and not core.endings.live
        # A request after it is refused at once, before any work.
        with pytest.raises(ShuttingDown, match="a test"):
            await consume(core, request("late"))
        assert not [w for w in backend.started if w.startswith("late#")]

    run(main())


def test_a_stream_answered_or_left_at_the_shutdown_ends_as_it_would_have():
    """Its final chunk already out: it just ends (no error after the answer). Its reader
    leaving as it is ended: the reader's cancellation goes through."""

    async def main():
        gate = asyncio.Event()
        gate.set()
        core = await make_core(FakeBackend(gate=gate))
        done = core.generate(request("done", max_tokens=1), time.monotonic())
        last = await anext(done)
        assert last.final is not None  # its reader holds the answer's last chunk
        core.endings.end_all("the server is shutting down: a test")
        with pytest.raises(StopAsyncIteration):
            await anext(done)
        core = await make_core(FakeBackend(gate=asyncio.Event()))
        leaving = asyncio.ensure_future(consume(core, request("leaving")))
        await asyncio.sleep(0.05)
        leaving.cancel()  # the reader leaves, and at once the server ends it
        core.endings.end_all("the server is shutting down: a test")
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert core.active == 0 and not core.endings.live

    run(main())


async def _handed_off_and_resumed(backend: FakeBackend, rid: str):
    """A disaggregated request of 8 tokens through a metered core over `backend` (which loses
    its decode worker): the metrics and its chunks."""
    from router.metrics import Metrics

    metrics = Metrics()
    core = RequestCore(backend, await backend.infos(), RouterConfig(), TOKENIZER, metrics)
    await core.refresh()
    req = replace(request(rid, max_tokens=8), path=RoutePath.DISAGGREGATED)
    return metrics, await consume(core, req)


def test_a_resumed_request_is_counted_as_its_answer_says_not_as_its_first_placement():
    """A handoff falls back (its transfer failed) as its decode worker dies; the request
    resumes on the other worker, colocated. Its answer says colocated, no kv_fallback: so do
    the metrics (no local prefill counted for a placement it left, nor its first path)."""
    backend = FakeBackend(
        num_prefill=0, num_decode=0, num_both=2, lose_decode_after=0,
        fallback=FallbackReason.TRANSFER_FAILED,
    )  # fmt: skip
    metrics, chunks = run(_handed_off_and_resumed(backend, "moved"))
    assert [p.path for p in backend.placements] == [RoutePath.DISAGGREGATED, RoutePath.COLOCATED]
    final = chunks[-1].final
    assert final.path is RoutePath.COLOCATED and final.kv_fallback is None and final.resumed == 1
    sample = metrics.registry.get_sample_value
    labels = {"finish_reason": "length", "frontend": "grpc"}
    assert sample("pdserve_requests_total", {**labels, "path": "colocated"}) == 1
    assert sample("pdserve_requests_total", {**labels, "path": "disaggregated"}) is None
    fell = sample("pdserve_local_prefill_fallbacks_total", {"reason": "transfer_failed"})
    assert not fell


def test_decode_rate_retry_hints_are_a_slot_apart_then_start_again_and_stay_bounded():
    from router.admission import RetrySpread

    now = [100.0]
    spread = RetrySpread(clock=lambda: now[0])
    assert [spread.hint(0.5, 256) for _ in range(3)] == [0.5, 1.0, 1.5]
    now[0] = 100.5
    assert spread.hint(0.5, 256) == 1.5  # the last one told is due at 101.5: 102.0
    now[0] = 200.0
    assert spread.hint(0.5, 256) == 0.5  # all of them came back long ago
    # A client that retries at once, its hint unheeded, moves the next one's on only within
    # the queue's length, and never past MOST_S.
    assert max(spread.hint(0.1, 8) for _ in range(100)) == pytest.approx(0.8)
    now[0] = 300.0
    assert max(spread.hint(1.0, 256) for _ in range(100)) == RetrySpread.MOST_S
    # Decodes placed beyond what the workers hold end first: 30 ahead, then this one's slot.
    now[0] = 1000.0
    assert spread.hint(0.1, 256, ahead=30) == pytest.approx(3.1)
    assert spread.hint(0.1, 256, ahead=30) == pytest.approx(3.2)
    # So many ahead that they would take minutes: half of MOST_S for them, the rest spread;
    # and once they have gone, the hints are short again (none pinned at MOST_S).
    now[0] = 2000.0
    hints = [spread.hint(0.5, 256, ahead=200) for _ in range(3)]
    assert hints == pytest.approx([30.5, 31.0, 31.5])
    now[0] = 2032.0
    assert spread.hint(0.5, 256) == pytest.approx(0.5)


def test_a_replan_is_counted_once_for_the_placement_the_answer_names():
    """Its prefill worker dies (re-planned onto the other) and then its decode worker: the
    request resumes and is re-planned again there. One request re-planned, counted once."""
    backend = FakeBackend(num_prefill=2, num_decode=2, replan=True, lose_decode_after=0)
    metrics, chunks = run(_handed_off_and_resumed(backend, "twice"))
    assert len(backend.placements) == 2 and len(backend.lost) == 1
    assert chunks[-1].final.resumed == 1
    assert metrics.registry.get_sample_value("pdserve_prefill_replans_total") == 1


def test_cached_tokens_are_the_hit_of_the_worker_that_prefilled_the_prompt():
    """A handoff reports its prefill worker's prefix-cache hit (the prompt tokens not computed
    for it), not its decode worker's (which only spares blocks of the transfer); colocated, or
    prefilled by the decode worker after a fallback, that worker's; never more than the
    prompt."""

    async def main(path: RoutePath, **kw) -> int:
        core = await make_core(FakeBackend(**kw))
        chunks = await consume(core, replace(request("c", n=64), path=path))
        return chunks[-1].final.cached_prompt_tokens

    dis, colo = RoutePath.DISAGGREGATED, RoutePath.COLOCATED
    assert run(main(dis, hits=(12, 40))) == 12
    assert run(main(colo, hits=(12, 40))) == 40
    # The prefill worker's KV sent, but the decode worker recomputed it after all.
    assert run(main(dis, hits=(12, 40), fallback=FallbackReason.TRANSFER_FAILED)) == 40
    assert run(main(colo, hits=(0, 500))) == 64
    # Handed off, then resumed colocated on the other worker (its decode worker lost): that
    # worker's own hit, not the first placement's prefill worker's.
    resumed = FakeBackend(
        num_prefill=0, num_decode=0, num_both=2, lose_decode_after=0, hits=(12, 20)
    )
    metrics, chunks = run(_handed_off_and_resumed(resumed, "moved"))
    assert chunks[-1].final.path is RoutePath.COLOCATED
    assert chunks[-1].final.cached_prompt_tokens == 20


def test_prompt_logprobs_are_asked_of_the_colocated_path_and_not_again_after_a_resume():
    """Under a policy that hands every prompt off, a request asking for prompt logprobs is
    placed colocated (its decision says why), asks the engine for them and predicts no prefix
    cache hit (the engine takes none for it); resumed after its first tokens, it asks for
    them no more and is placed as the policy says."""
    from router.policy import Policy, PolicyConfig

    async def main():
        backend = FakeBackend(num_prefill=1, num_decode=2, lose_decode_after=3)
        core = await make_core(backend, policy=PolicyConfig(policy=Policy.DISAGGREGATED))
        req = request("scored", max_tokens=8)
        req = replace(req, sampling=replace(req.sampling, prompt_logprobs=2))
        plan_hashes = core.plan(req)[0].hashes
        chunks = await consume(core, req)
        return backend, core, chunks, plan_hashes

    backend, core, chunks, plan_hashes = run(main())
    assert plan_hashes == ()
    assert [p.path for p in backend.placements] == [RoutePath.COLOCATED, RoutePath.DISAGGREGATED]
    assert [sp.prompt_logprobs for sp in backend.sampling] == [2, None]
    assert core.records[0].decision.reason_code == "prompt_logprobs"
    assert "prompt logprobs" in core.records[0].decision.reason
    assert sum(len(c.token_ids) for c in chunks) == 8 and core.resumed == 1


def test_requests_of_one_token_are_answered_by_the_prefill_worker_and_book_no_decode():
    """On one prefill and one decode worker, idle, requests of one token are answered whole by
    the prefill worker: their first tokens train the answers' own TTFT correction (not the
    colocated path's), they count in neither the decodes' arrival rate nor their output
    lengths, no step target is tightened for them, and the worker's books hold nothing after.
    A request that decodes is counted, as before."""

    async def main():
        backend = FakeBackend(num_prefill=1, num_decode=1)
        plain = backend.worker_info
        backend.worker_info = lambda w: replace(plain(w), step_target_s=10.0)  # loose: tightened
        core = await make_core(backend, tune_step_target=True)
        demand = core.planner.demand
        for i in range(8):
            chunks = await consume(core, request(f"one{i}", n=16 + 8 * i, max_tokens=1))
            final = chunks[-1].final
            assert final is not None and final.completion_tokens == 1
            assert (final.path, final.decode_worker) == (RoutePath.COLOCATED, "prefill-0")
        assert [p.decode_worker for p in backend.placements] == ["prefill-0"] * 8
        assert len(core.planner.answer_bias._obs) == 8
        assert not core.planner.bias[RoutePath.COLOCATED]._obs
        assert not demand._arrivals and not demand._outputs
        assert "prefill-0" not in backend.step_targets
        p = core.states["prefill-0"]
        assert (p.queued_prefills, p.batch) == (0, 0)
        await consume(core, request("decodes", max_tokens=4))
        assert len(demand._arrivals) == 1 and list(demand._outputs) == [(4, 4)]
        assert backend.placements[-1].decode_worker == "decode-0"
        await asyncio.sleep(0.1)  # the tightening call, sent without waiting
        assert "decode-0" in backend.step_targets  # tightened for the request that decodes

    run(main())
