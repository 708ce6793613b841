"""The router's load poll (router/load_poll.py) over real Ray actors that stand in for workers'
`load`: a slow worker holds up no other's figures, its answer comes to a later poll, and a
worker that answers nothing (or only errors) for the hang timeout is reported hung."""

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
def workers():
    init_ray(None)
    hs = [WorkerHandle(w, WorkerRole.DECODE, Loads.remote(w), 0) for w in ("decode-0", "decode-1")]
    ray.get([h.actor.set.remote(0.0) for h in hs], timeout=60)
    yield hs
    for h in hs:
        ray.kill(h.actor)


def ids(loads: list[WorkerLoad]) -> list[str]:
    return sorted(ld.worker_id for ld in loads)


@pytest.mark.timeout(60)
def test_a_slow_worker_holds_up_no_other_and_answers_a_later_poll(workers):
    fast, slow = workers
    poll = LoadPoll(hang_timeout_s=0)
    ray.get(slow.actor.set.remote(1.5), timeout=10)
    before = ray.get(slow.actor.count.remote(), timeout=10)
    t0 = time.monotonic()
    first = asyncio.run(poll.poll(workers, wait_s=0.3))
    assert time.monotonic() - t0 < 1.2  # the slow one was not waited for
    assert ids(first.loads) == ["decode-0"] and not first.failed and not first.hung
    time.sleep(1.5)
    # One call in flight per worker: the slow one's first answer comes now, and no second
    # call went out meanwhile.
    second = asyncio.run(poll.poll(workers, wait_s=0.3))
    assert ids(second.loads) == ["decode-0", "decode-1"]
    assert ray.get(slow.actor.count.remote(), timeout=10) - before == 1
    ray.get(slow.actor.set.remote(0.0), timeout=10)


@pytest.mark.timeout(60)
def test_a_worker_silent_or_failing_for_the_hang_timeout_is_hung_and_no_longer_polled(workers):
    fast, slow = workers
    poll = LoadPoll(hang_timeout_s=1.0)
    asyncio.run(poll.poll(workers, wait_s=1.0))  # both answer: the clock starts
    ray.get(slow.actor.set.remote(0.0, fail=True), timeout=10)
    seen = []
    deadline = time.monotonic() + 10
    while not seen:
        assert time.monotonic() < deadline, "never reported hung"
        out = asyncio.run(poll.poll(workers, wait_s=0.2))
        assert ids(out.loads) == ["decode-0"]
        assert all(h is slow and "engine stopped" in str(e) for h, e in out.failed)
        seen = out.hung
        time.sleep(0.1)
    [(h, silent)] = seen
    assert h is slow and silent > 1.0
    ray.get(slow.actor.set.remote(0.0), timeout=10)


@pytest.mark.timeout(60)
def test_overlapping_polls_each_take_what_they_waited_for(workers):
    poll = LoadPoll(hang_timeout_s=5.0)
    ray.get(workers[1].actor.set.remote(0.5), timeout=10)
    before = ray.get(workers[1].actor.count.remote(), timeout=10)

    async def three() -> list[Polled]:  # as the router's poller and a caller on its loop
        return await asyncio.gather(*(poll.poll(workers, wait_s=2.0) for _ in range(3)))

    for out in asyncio.run(three()):
        assert ids(out.loads) == ["decode-0", "decode-1"] and not out.failed
    calls = ray.get(workers[1].actor.count.remote(), timeout=10) - before
    assert calls == 1  # one call, three polls
    ray.get(workers[1].actor.set.remote(0.0), timeout=10)
