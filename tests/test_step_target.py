"""The router's tuning of each worker's step target from the tail of its requests' gaps."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest

from engine.async_engine import AsyncEngine
from router.core import RequestCore
from router.core_types import RouterConfig
from router.fake_backend import FakeBackend, fake_info
from router.pool_state import WorkerState
from router.step_target import StepTargetConfig, StepTargets
from tests.helpers import make_engine
from tests.test_router_core import TOKENIZER
from worker_protocol.host import EngineHost


def worker(target_s: float | None, slo_s: float | None = None, wid: str = "both-0") -> WorkerState:
    state = WorkerState(replace(fake_info(wid, "both"), step_target_s=target_s))
    if slo_s is not None:
        state.add_decode("r", 100, slo_s, local=False)
    return state


def test_a_tail_past_the_slo_shrinks_the_target_and_one_well_under_it_grows_it_back():
    tune = StepTargets(StepTargetConfig(window_s=20.0, min_gaps=50))
    w = worker(0.100, slo_s=0.150)
    w.measured.observe_gaps([0.05] * 50 + [0.30] * 10, now=100.0)  # p99 0.30 s, twice the SLO
    assert tune.retarget(w, now=101.0) == pytest.approx(0.070)  # by 30% at most
    w.model.step_target_s = 0.070
    tune.changed(w.worker_id, now=101.0)
    assert tune.retarget(w, now=105.0) is None  # once per half window
    w.measured.observe_gaps([0.05] * 40, now=112.0)  # p99 0.05 s, a third of the SLO
    # Only the gaps since the change count: 40 are too few, the slow ones before it are out.
    assert tune.retarget(w, now=113.0) is None
    w.measured.observe_gaps([0.05] * 60, now=115.0)
    assert tune.retarget(w, now=125.0) == pytest.approx(0.0875)  # by 25% at most
    w.model.step_target_s = 0.0875
    tune.changed(w.worker_id, now=125.0)
    w.measured.observe_gaps([0.131] * 100, now=140.0)  # p99 at 87% of the SLO: near the goal of 90%
    assert tune.retarget(w, now=140.0) is None


def test_the_target_stays_within_the_slo_and_needs_enough_gaps():
    tune = StepTargets()
    few = worker(0.100, slo_s=0.150, wid="both-1")
    few.measured.observe_gaps([1.0] * 10, now=10.0)
    assert tune.retarget(few, now=11.0) is None  # 10 gaps say too little
    loose = worker(
        0.800, slo_s=0.150, wid="both-2"
    )  # started from a default SLO far looser than asked
    assert tune.retarget(loose, now=0.0) == pytest.approx(0.8 * 0.150)
    floor = worker(0.035, slo_s=0.150, wid="both-3")
    floor.measured.observe_gaps([3.0] * 100, now=50.0)
    assert tune.retarget(floor, now=50.0) == pytest.approx(0.2 * 0.150)  # no lower than 20%
    assert tune.retarget(worker(None, slo_s=0.15), now=0.0) is None  # no target: untouched


def test_a_worker_with_no_request_to_decode_there_keeps_its_target():
    """A worker's target is tuned for the ITL SLOs of the requests decoding there and of the
    colocated prompts queued there, that can still attain; with none, it is left as it is (the
    server's default SLO, 1 s, would have raised a 70 ms target to its floor, 200 ms)."""
    tune = StepTargets()
    idle = worker(0.070, wid="both-4")
    idle.measured.observe_gaps([0.05] * 100, now=0.0)
    assert tune.retarget(idle, now=1.0) is None  # none decodes there, nor will: left as it is
    idle.add_prefill("c", 1000, 5e5, local=True, itl_slo_s=0.145)  # colocated, prefilling
    assert tune.retarget(idle, now=1.0) == pytest.approx(0.0875)  # by 25%, for its 145 ms
    idle.add_decode("d", 100, 0.060, local=False)  # a tighter one decoding: past its 60 ms
    assert tune.retarget(idle, now=1.0) == pytest.approx(0.8 * 0.060)
    idle.unprotect("d")  # past its TTFT SLO: the colocated prompt's SLO holds again
    assert tune.retarget(idle, now=1.0) == pytest.approx(0.0875)
    idle.unprotect("c")  # neither can attain any more: nothing to tune for
    assert tune.retarget(idle, now=1.0) is None


def test_a_loose_slo_grows_a_tight_target_by_a_quarter_at_most():
    """A 70 ms target, kept from a tighter request, under requests with the default 1 s ITL SLO:
    the floor of that SLO (200 ms) stops a shrink, it does not raise the target; gaps well
    within the SLO grow it by 25%, and gaps past it leave it."""
    tune = StepTargets()
    w = worker(0.070, slo_s=1.0)
    w.measured.observe_gaps([0.05] * 100, now=0.0)
    assert tune.retarget(w, now=1.0) == pytest.approx(0.0875)
    slow = worker(0.070, slo_s=1.0, wid="both-5")
    slow.measured.observe_gaps([2.0] * 100, now=0.0)
    assert tune.retarget(slow, now=1.0) is None


def test_the_target_is_a_step_whose_gaps_take_the_slo():
    """A worker whose requests see gaps 1.5x its steps: a request's 150 ms ITL SLO holds its
    gaps, so its target (a step) starts at 0.8 x 100 ms, and grows no further than 100 ms."""
    tune = StepTargets()
    w = worker(0.800, slo_s=0.150)
    w.measured._gap_factor = 1.5
    assert tune.for_request(w, 0.150) == pytest.approx(0.8 * 0.100)
    w.model.step_target_s = 0.095
    assert tune.for_request(w, 0.150) is None  # under 100 ms already
    w.measured.observe_gaps(
        [0.05] * 100, now=50.0
    )  # p99 a third of the SLO: grow, to 100 ms at most
    assert tune.retarget(w, now=50.0) == pytest.approx(0.100)


def tuned_core(backend: FakeBackend) -> RequestCore:
    """A core tuning step targets over one worker that does both (target 100 ms), where a request
    with a 150 ms ITL SLO decodes and requests saw 100 gaps of 300 ms; after one load poll."""

    async def main():
        infos = [replace(i, step_target_s=0.1) for i in await backend.infos()]
        config = RouterConfig(slo_itl_s=0.15, tune_step_target=True)
        core = RequestCore(backend, infos, config, TOKENIZER)
        core.states["both-0"].add_decode("r", 100, 0.15, local=False)
        core.states["both-0"].measured.observe_gaps([0.3] * 100)
        await core.refresh()
        return core

    return asyncio.run(main())


def test_the_core_sends_a_retargeted_worker_its_new_step_target():
    backend = FakeBackend(num_prefill=0, num_decode=0, num_both=1)
    core = tuned_core(backend)
    assert backend.step_targets == {"both-0": pytest.approx(0.07)}
    assert core.states["both-0"].model.step_target_s == pytest.approx(0.07)


def test_a_worker_that_does_not_take_its_new_target_keeps_its_old_one():
    class Refusing(FakeBackend):
        async def set_step_target(
            self, worker_id: str, target_s: float | None, seq: int = 0
        ) -> None:
            raise RuntimeError("mid-restart")

    # The call fails: logged, nothing recorded, polling goes on.
    core = tuned_core(Refusing(num_prefill=0, num_decode=0, num_both=1))
    assert core.states["both-0"].model.step_target_s == pytest.approx(0.1)
    assert core.step_targets is not None and "both-0" not in core.step_targets._changed


def test_a_request_tighter_than_a_workers_target_brings_it_down_before_its_prefill_runs():
    """The server's default ITL SLO (1 s) set the target at 800 ms; a request asking for 100 ms
    is placed there: the target drops to 80 ms before the backend runs its prefill (the tuning
    from gaps would only act once it decodes). A looser request leaves it."""
    from tests.test_router_core import consume, request

    class Watching(FakeBackend):
        def generate(self, prompt_token_ids, params, placement, on_prefill=None):
            self.seen.append(dict(self.step_targets))  # the targets when the work starts
            return super().generate(prompt_token_ids, params, placement, on_prefill)

    async def main():
        backend = Watching(num_prefill=0, num_decode=0, num_both=1)
        backend.seen = []
        infos = [replace(i, step_target_s=0.8) for i in await backend.infos()]
        core = RequestCore(backend, infos, RouterConfig(slo_itl_s=1.0, tune_step_target=True),
                           TOKENIZER)  # fmt: skip
        await core.refresh()
        await consume(core, replace(request("tight"), slo_itl_ms=100.0))
        await asyncio.sleep(0.05)  # the call is not awaited by the request: let it end
        await consume(core, replace(request("loose"), slo_itl_ms=500.0))
        await asyncio.sleep(0.05)
        return backend, core

    backend, core = asyncio.run(asyncio.wait_for(main(), 30))
    assert backend.seen == [{"both-0": pytest.approx(0.08)}] * 2
    assert core.states["both-0"].model.step_target_s == pytest.approx(0.08)


def test_a_tighter_request_placed_while_a_target_call_is_in_flight_gets_its_target_after_it():
    """A request asking for 500 ms sends both-0 (at 800 ms) a 400 ms target; before the worker
    answers, one asking for 100 ms is placed there, predicted under 80 ms: once the first call
    ends, the second goes (one call per worker at a time)."""

    class Slow(FakeBackend):
        def set_step_target(self, worker_id: str, target_s: float | None, seq: int = 0):
            async def later() -> None:
                await self.answer.wait()
                self.step_targets[worker_id] = target_s

            return later()

    async def main():
        backend = Slow(num_prefill=0, num_decode=0, num_both=1)
        backend.answer = asyncio.Event()
        infos = [replace(i, step_target_s=0.8) for i in await backend.infos()]
        core = RequestCore(backend, infos, RouterConfig(slo_itl_s=1.0, tune_step_target=True),
                           TOKENIZER)  # fmt: skip
        core.target_calls.tighten("both-0", 0.5)
        core.target_calls.tighten("both-0", 0.1)  # in flight: waits
        core.target_calls.tighten("both-0", 0.3)  # looser than the one waiting
        await asyncio.sleep(0.01)
        assert backend.step_targets == {}
        backend.answer.set()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not core.target_calls.tightening:
                break
        return backend, core

    backend, core = asyncio.run(asyncio.wait_for(main(), 30))
    assert backend.step_targets == {"both-0": pytest.approx(0.08)}
    assert core.states["both-0"].model.step_target_s == pytest.approx(0.08)
    assert not core.target_calls.tighten_next


def test_a_target_call_that_ends_after_a_newer_one_is_not_recorded():
    """Two step targets sent to one worker, the older answering last (Ray may run a worker's
    calls out of order, and the worker then ignores the older: EngineHost.set_step_target):
    the router keeps the newer as the worker's target."""

    class Reordered(FakeBackend):
        def set_step_target(self, worker_id: str, target_s: float | None, seq: int = 0):
            gate = self.gates[len(self.sent)]
            self.sent.append(target_s)

            async def later() -> None:
                await gate.wait()

            return later()

    async def main():
        backend = Reordered(num_prefill=0, num_decode=0, num_both=1)
        backend.gates, backend.sent = [asyncio.Event(), asyncio.Event()], []
        infos = [replace(i, step_target_s=0.8) for i in await backend.infos()]
        core = RequestCore(backend, infos, RouterConfig(slo_itl_s=1.0, tune_step_target=True),
                           TOKENIZER)  # fmt: skip
        state = core.states["both-0"]
        older = asyncio.ensure_future(core.target_calls.set_targets([(state, 0.4)], "older"))
        await asyncio.sleep(0.01)
        newer = asyncio.ensure_future(core.target_calls.set_targets([(state, 0.2)], "newer"))
        await asyncio.sleep(0.01)
        assert backend.sent == [0.4, 0.2]
        backend.gates[1].set()
        await newer
        backend.gates[0].set()
        await older
        return state.model.step_target_s

    assert asyncio.run(asyncio.wait_for(main(), 30)) == pytest.approx(0.2)


def test_a_worker_ignores_a_step_target_sent_before_the_latest_it_took():
    """The worker's side, on a real engine: numbered calls run out of order leave the newest
    target in force; an unnumbered call is always taken."""
    host = SimpleNamespace(_target_seq=0, aeng=AsyncEngine(make_engine()))
    sched = host.aeng.engine.scheduler

    async def main() -> list[float | None]:
        seen = []
        for target, seq in [(0.05, 2), (0.5, 1), (0.08, 3), (0.3, 0)]:
            await EngineHost.set_step_target(host, target, seq)
            seen.append(sched.sizer.target_s if sched.sizer else None)
        return seen

    try:
        assert asyncio.run(asyncio.wait_for(main(), 30)) == [0.05, 0.05, 0.08, 0.3]
    finally:
        host.aeng.shutdown()
