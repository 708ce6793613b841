"""The sending side of a prefill (worker_protocol/kv_sender.py) on a real engine, in process."""

from __future__ import annotations

import asyncio
import time

from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams
from tests.helpers import assert_pool_free, hf_greedy, make_engine, random_prompts
from worker_protocol.ended import EndedRequests
from worker_protocol.kv_sender import KVSenderSide
from worker_protocol.messages import PrefillResult, WorkRequest

STEP_S = 1.0  # each engine step lasts this long at least: a busy worker's prefill steps


class Sender(KVSenderSide):
    def __init__(self, aeng: AsyncEngine) -> None:
        self.init_sender()
        self.aeng, self.engine, self.ended = aeng, aeng.engine, EndedRequests()


def test_a_first_token_does_not_wait_for_the_step_that_runs_after_it():
    """A prompt's last chunk shares a step with the start of another prompt, whose further steps
    then run. Its first token goes back once its send has ended (none here: the decode side
    holds the prompt), not after the next step; the engine frees its blocks after that step."""
    eng = make_engine("tiny-llama", budget=24)
    run_step = eng.step

    def slow_step(*args, **kwargs):
        out = run_step(*args, **kwargs)
        time.sleep(STEP_S)
        return out

    eng.step = slow_step  # type: ignore[method-assign]
    host = Sender(AsyncEngine(eng))
    short, long = random_prompts([10, 60], seed=5)  # steps: 10 + 14, 24, 22
    sp = SamplingParams(max_tokens=4, temperature=0.0)

    async def main() -> tuple[PrefillResult, float, PrefillResult]:
        t0 = time.monotonic()
        first = asyncio.ensure_future(host.prefill(WorkRequest("a", tuple(short), sp), "D", (), 0))
        other = asyncio.ensure_future(host.prefill(WorkRequest("b", tuple(long), sp), "D", (), 0))
        a = await first
        took = time.monotonic() - t0
        return a, took, await other

    try:
        a, took, b = asyncio.run(asyncio.wait_for(main(), 60))
        assert a.first_token == hf_greedy("tiny-llama", short, 1)[0]
        assert b.first_token == hf_greedy("tiny-llama", long, 1)[0]
        assert took < 1.9 * STEP_S, f"{took:.2f} s: it waited for the step after its own"
        deadline = time.monotonic() + 10
        while not eng.kv.pool.all_free() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        host.aeng.shutdown()
    assert_pool_free(eng)


def test_an_abort_while_a_cut_prefill_ends_its_send_frees_the_blocks_only_after_the_send():
    """A prefill is cut (cancelled) with its send under way on a stuck link: ending the send
    waits for the lane, off the event loop. The router's abort comes meanwhile: it too waits
    for the send to end before the engine frees the prompt's blocks."""
    from concurrent.futures import Future

    from kv_transfer import TransferStatus

    events: list[str] = []

    class StuckSend:
        live = True

        def poll(self, rid: str) -> TransferStatus:
            return TransferStatus.TRANSFERRING if self.live else TransferStatus.FAILED

        def abort(self, rid: str) -> None:
            time.sleep(0.3)  # the lane lets go of the blocks
            if self.live:
                self.live = False
                events.append("send ended")

        def release(self, rid: str) -> None:
            pass

    conn = StuckSend()

    class Engine:
        """What the sender asks of its engine: the prompt's step never comes."""

        def call_threadsafe(self, fn):
            fut: Future = Future()
            fut.set_result(fn(self))
            return fut

        async def call(self, fn):
            return fn(self)

        async def add(self, rid, fn):
            return None

        async def stream(self, rid, q):
            await asyncio.sleep(60)
            yield  # never reached

        async def abort(self, rid: str) -> None:
            self.release_blocks(rid)

        def release_blocks(self, rid: str) -> bool:
            events.append("blocks freed while the send " + ("runs" if conn.live else "ended"))
            return True

    host = KVSenderSide()
    host.init_sender()
    host.ended, host.connector, host.aeng = EndedRequests(), conn, Engine()  # type: ignore[assignment]

    async def main() -> None:
        sp = SamplingParams(max_tokens=4)
        cut = asyncio.create_task(host.prefill(WorkRequest("r", (1, 2, 3), sp), "D", (5, 6), 0))
        await asyncio.sleep(0.05)
        host._sends["r"].started = True  # its first layers are on the wire
        cut.cancel()
        await asyncio.sleep(0.05)  # its send is ending, on a thread
        await host.abort_prefill("r")  # the router's abort
        try:
            await cut
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(0.5)

    asyncio.run(asyncio.wait_for(main(), 10))
    assert events[0] == "send ended" and "blocks freed while the send runs" not in events
    assert events.count("blocks freed while the send ended") == 2 and not host._sends


def test_a_send_that_fails_inside_a_step_is_ended_off_the_engine_thread():
    """A layer's send raises inside the step's per-layer hook: the send is marked failed at
    once and ended on a thread of its own (ending it waits for its lane, up to the I/O timeout
    on a stuck link), so the step, and every other request in it, goes on."""
    import threading
    from types import SimpleNamespace

    from engine.outputs import ScheduledRequest, SchedulerOutput
    from worker_protocol.kv_sender import _PendingSend

    ended_on: list[threading.Thread] = []

    class Failing:
        def start_send(self, req, cache) -> None:
            pass

        def send_layer(self, rid: str, layer: int) -> None:
            raise ValueError("layer 0 announced twice")

        def abort(self, rid: str) -> None:
            time.sleep(0.5)  # the lane lets go
            ended_on.append(threading.current_thread())

    host = KVSenderSide()
    host.init_sender()
    host.connector = Failing()  # type: ignore[assignment]
    host.layout = SimpleNamespace(num_layers=2)  # type: ignore[assignment]
    host.spec = SimpleNamespace(kv_transfer_deadline_s=5.0)  # type: ignore[assignment]
    host.engine = SimpleNamespace(runner=SimpleNamespace(cache=None))  # type: ignore[assignment]
    host._sends["r"] = _PendingSend("D", (5, 6), 0)
    step = SchedulerOutput((ScheduledRequest("r", (1,), 3, (1, 2), True, SamplingParams()),), 1)
    t0 = time.monotonic()
    host.on_layer(0, step)
    assert time.monotonic() - t0 < 0.2  # the step goes on
    assert host._sends["r"].error == "ValueError: layer 0 announced twice" and not ended_on
    deadline = time.monotonic() + 5
    while not ended_on and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(ended_on) == 1 and ended_on[0] is not threading.main_thread()


def test_a_send_ended_before_its_first_token_is_released_with_the_prompts_blocks():
    """The router's abort ends a prefill whose send had started: no first token comes, the send
    is over (FAILED), and the prefill forgets it in the connector (else its record stays for
    good) as it frees the prompt's blocks."""
    from concurrent.futures import Future

    from kv_transfer import TransferStatus

    released: list[str] = []
    freed: list[str] = []

    class Ended:
        def poll(self, rid: str) -> TransferStatus:
            return TransferStatus.FAILED

        def release(self, rid: str) -> None:
            released.append(rid)

    class Engine:
        """The prompt's stream ends without a token (its request aborted)."""

        def call_threadsafe(self, fn):
            fut: Future = Future()
            fut.set_result(fn(self))
            return fut

        async def add(self, rid, fn):
            return None

        async def stream(self, rid, q):
            await asyncio.sleep(0.1)
            return
            yield  # an async generator with nothing to give

        def release_blocks(self, rid: str) -> bool:
            freed.append(rid)
            return True

    host = KVSenderSide()
    host.init_sender()
    host.ended, host.connector, host.aeng = EndedRequests(), Ended(), Engine()  # type: ignore[assignment]

    async def main() -> PrefillResult:
        sp = SamplingParams(max_tokens=4)
        prefill = asyncio.create_task(host.prefill(WorkRequest("r", (1, 2, 3), sp), "D", (5,), 0))
        await asyncio.sleep(0.05)
        host._sends["r"].started = True  # its send started, then the abort ended it
        return await prefill

    result = asyncio.run(asyncio.wait_for(main(), 10))
    assert result.first_token is None and result.transfer_ok is False
    assert released == ["r"] and freed == ["r"] and not host._sends
