"""The router's load poll (router/load_poll.py) over real Ray actors that stand in for workers'
`load`: a slow worker holds up no other's figures and is waited for once, its answer comes to a
later poll, and a worker that answers nothing (or only errors) for the hang timeout is reported
hung, once, and no longer polled."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from router.load_poll import LoadPoll, Polled
from router.ray_runtime import init_ray
from router.workers import WorkerHandle
from worker_protocol.messages import WorkerLoad, WorkerRole


@ray.remote(num_cpus=0, max_concurrency=4)
class Loads:
    """A worker's `load`, answering at once, after `delay_s`, or with an error."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.delay_s = 0.0
        self.fail = False
        self.calls = 0

    def set(self, delay_s: float, fail: bool = False) -> None:
        self.delay_s, self.fail = delay_s, fail

    def count(self) -> int:
        return self.calls

    def load(self) -> WorkerLoad:
        self.calls += 1
        time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("engine stopped")
        return WorkerLoad(self.worker_id, WorkerRole.DECODE, 0, 0, 0, 0.0, 8, 8, 0)


@pytest.fixture(scope="module")
def actors():
    init_ray(None)
    hs = [WorkerHandle(w, WorkerRole.DECODE, Loads.remote(w), 0) for w in ("decode-0", "decode-1")]
    ray.get([h.actor.set.remote(0.0) for h in hs], timeout=60)
    yield hs
    for h in hs:
        ray.kill(h.actor)


@pytest.fixture
def workers(actors):
    yield actors
    ray.get([h.actor.set.remote(0.0) for h in actors], timeout=30)  # as they were


def ids(loads: list[WorkerLoad]) -> list[str]:
    return sorted(ld.worker_id for ld in loads)


def calls(h: WorkerHandle) -> int:
    return ray.get(h.actor.count.remote(), timeout=10)


@pytest.mark.timeout(60)
def test_a_slow_worker_is_waited_for_once_and_answers_a_later_poll(workers):
    fast, slow = workers
    poll = LoadPoll(hang_timeout_s=0)
    ray.get(slow.actor.set.remote(6.0), timeout=10)
    before = calls(slow)
    t0 = time.monotonic()
    first = asyncio.run(poll.poll(workers, wait_s=2.0))
    assert time.monotonic() - t0 < 4.0  # the slow one held it up for the wait alone
    assert ids(first.loads) == ["decode-0"] and not first.failed and not first.hung
    # Its call still out, the next poll waits for the fast one's new call, not for it again.
    t0 = time.monotonic()
    second = asyncio.run(poll.poll(workers, wait_s=2.0))
    assert time.monotonic() - t0 < 1.5
    assert ids(second.loads) == ["decode-0"]
    deadline = time.monotonic() + 20
    while "decode-1" not in ids(asyncio.run(poll.poll(workers, wait_s=1.0)).loads):
        assert time.monotonic() < deadline, "the slow answer never came"
        time.sleep(0.2)
    assert calls(slow) - before == 1  # one call in flight per worker, however many polls


@pytest.mark.timeout(60)
@pytest.mark.parametrize("silent", [True, False], ids=["silent", "failing"])
def test_a_worker_silent_or_failing_for_the_hang_timeout_is_hung_once(workers, silent):
    fast, slow = workers
    poll = LoadPoll(hang_timeout_s=3.0)
    asyncio.run(poll.poll(workers, wait_s=5.0))  # both answer: the clock starts
    ray.get(slow.actor.set.remote(*((30.0,) if silent else (0.0, True))), timeout=10)
    t0 = time.monotonic()
    seen: list[Polled] = []
    # Who has been silent for 1.5 s, poll by poll: half the timeout on, a phase 1.5 s wide
    # that a stalled poll on a loaded host does not step over.
    quiet: list[set[str]] = []
    while not any(out.hung for out in seen):
        assert time.monotonic() - t0 < 15, "never reported hung"
        seen.append(asyncio.run(poll.poll(workers, wait_s=0.5)))
        quiet.append(poll.silent(1.5))
        time.sleep(0.1)
    assert {"decode-1"} in quiet[:-1] and all(q <= {"decode-1"} for q in quiet)
    [(h, silent_s)] = seen[-1].hung
    assert h is slow and 3.0 < silent_s < 3.0 + 3.0
    assert "decode-0" in ids([ld for out in seen for ld in out.loads])
    assert "decode-1" not in ids([ld for out in seen[1:] for ld in out.loads])
    failed = [e for out in seen for _, e in out.failed]
    assert (not failed) if silent else all("engine stopped" in str(e) for e in failed) and failed
    # Reported once: while it is still among the handles (its pool has not stopped it yet),
    # the clock starts again.
    assert not asyncio.run(poll.poll(workers, wait_s=0.5)).hung


@pytest.mark.timeout(60)
def test_a_worker_gone_from_the_pools_is_forgotten(workers):
    fast, slow = workers
    poll = LoadPoll(hang_timeout_s=30.0)
    asyncio.run(poll.poll(workers, wait_s=5.0))
    ray.get(slow.actor.set.remote(2.0), timeout=10)
    asyncio.run(poll.poll(workers, wait_s=0.2))  # its call is out, past a wait
    assert slow in poll._calls and slow in poll._since and slow in poll._slow
    asyncio.run(poll.poll([fast], wait_s=0.5))  # it left its pool
    assert slow not in poll._calls and slow not in poll._since and slow not in poll._slow


@pytest.mark.timeout(60)
def test_polls_far_apart_take_no_worker_that_answers_them_for_hung(workers):
    poll = LoadPoll(hang_timeout_s=1.0)
    asyncio.run(poll.poll(workers, wait_s=5.0))
    time.sleep(1.5)  # no poll meanwhile (a caller without a poller, or a stalled loop)
    assert not asyncio.run(poll.poll(workers, wait_s=5.0)).hung
    # A call that outlasts a wait, answered while no poll runs, is no hang either.
    ray.get(workers[1].actor.set.remote(0.5), timeout=10)
    asyncio.run(poll.poll(workers, wait_s=0.1))
    time.sleep(3.0)  # its answer (0.5 s) is in long before, however loaded the host
    out = asyncio.run(poll.poll(workers, wait_s=5.0))
    assert not out.hung and ids(out.loads) == ["decode-0", "decode-1"]


@pytest.mark.timeout(60)
def test_overlapping_polls_each_take_what_they_waited_for(workers):
    poll = LoadPoll(hang_timeout_s=5.0)
    ray.get(workers[1].actor.set.remote(0.5), timeout=10)
    before = calls(workers[1])

    async def three() -> list[Polled]:  # as the router's poller and a caller on its loop
        return await asyncio.gather(*(poll.poll(workers, wait_s=3.0) for _ in range(3)))

    for out in asyncio.run(three()):  # each waited for the calls the first sent
        assert ids(out.loads) == ["decode-0", "decode-1"] and not out.failed and not out.hung
    assert calls(workers[1]) - before == 1  # one call, three polls


@pytest.mark.timeout(60)
def test_the_stop_probe_names_the_worker_that_gives_no_load_within_its_wait(workers):
    """Cluster.shutdown's probe: a worker that answers within the wait is not named, one that
    does not (slow, stopped) or fails is, however the poll's books stood before (no poll may
    have run since the worker stopped)."""
    fast, slow = workers
    poll = LoadPoll(hang_timeout_s=30.0)
    asyncio.run(poll.poll(workers, wait_s=5.0))  # both answered: neither silent nor polled
    assert poll.unanswering(workers, 5.0) == set()
    ray.get(slow.actor.set.remote(8.0), timeout=10)
    t0 = time.monotonic()
    assert poll.unanswering(workers, 3.0) == {"decode-1"}
    assert time.monotonic() - t0 < 6.0  # the wait, not the slow answer
    assert poll.unanswering([fast], 3.0) == set()
    assert poll.unanswering(workers, 20.0) == set()  # the slow call's answer, taken
    ray.get(slow.actor.set.remote(0.0, True), timeout=10)  # its next call fails
    assert poll.unanswering(workers, 5.0) == {"decode-1"}


def test_a_worker_whose_full_step_may_pass_half_the_hang_timeout_is_named_at_start():
    """A step answers no load: where a worker's full step (its whole token budget of prompt) is
    predicted at half the hang timeout or more (a large model on a CPU), the start says so and
    which options change it; not otherwise, nor with the watchdog off."""
    from dataclasses import replace

    from engine.device_rate import DeviceRate
    from router.fake_backend import fake_info
    from router.load_poll import slow_step_warning

    fast = fake_info("decode-0", WorkerRole.DECODE)  # 1e11 FLOP/s: well under a second
    slow = replace(
        fake_info("decode-1", WorkerRole.DECODE, max_model_len=8192),
        num_params=7_000_000_000,
        weight_bytes=14_000_000_000,
        max_num_batched_tokens=8192,
    )
    assert slow_step_warning([fast], 60.0) is None
    said = slow_step_warning([fast, slow], 60.0)
    assert said is not None and said.startswith("decode-1: a step of 8192 prompt tokens"), said
    assert "--worker-hang-timeout" in said and "--max-num-batched-tokens" in said, said
    assert slow_step_warning([fast, slow], 0) is None  # no watchdog, nothing to say
    quick = replace(slow, rate=DeviceRate(flops_per_s=1e15, bytes_per_s=3e12))  # a GPU's rate
    assert slow_step_warning([quick], 60.0) is None
