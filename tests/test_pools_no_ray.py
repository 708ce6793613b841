"""The pools' choices that need no Ray runtime. Where a new worker goes (router/workers.py
spread_node): the live node with room for it holding the fewest workers that are not dead or
stopped, none of the nodes to avoid while another has room; none (Ray's choice) where no node has
room. Which nodes a replacement avoids (Pools._replace): the one its worker hung on, and each one
a start of it failed on. A worker Ray's memory monitor killed is dead at once; a resize past
--max-workers is refused before any actor starts; one that removes a worker whose replacement is
still starting stops it at once."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.cluster_config import PoolConfig
from router.pools import HUNG, Pools
from router.resize import ResizeReplaced, Resizes
from router.workers import Placement, WorkerHandle, WorkerStatus, spread_node
from worker_protocol.messages import WorkerRole

NONE: dict = {}  # no pool asks for anything
ONE_GPU = {WorkerRole.DECODE: Placement(gpus=1.0)}


def node(node_id: str, alive: bool = True, **resources: float) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 4.0, **resources}}


def on(node_id: str | None, status: WorkerStatus = WorkerStatus.READY) -> WorkerHandle:
    return WorkerHandle("decode-0", WorkerRole.DECODE, None, 0, node_id, status)  # type: ignore[arg-type]


def test_the_fitting_node_with_the_fewest_live_workers():
    nodes = [node("a"), node("b"), node("c", alive=False)]
    assert spread_node(Placement(), nodes, [on("a")], NONE) == "b"
    assert spread_node(Placement(), nodes, [on("a", WorkerStatus.DEAD)], NONE) == "a"  # not counted
    assert spread_node(Placement(resources=(("gpu_node", 1.0),)), nodes, [], NONE) is None
    # Draining workers are leaving: b's two count for nothing, a's one stays.
    leaving = [on("a"), on("b", WorkerStatus.DRAINING), on("b", WorkerStatus.DRAINING)]
    assert spread_node(Placement(), nodes, leaving, NONE) == "b"


def test_a_node_whose_gpus_the_pools_hold_takes_no_more():
    """Node a's one GPU is held by a worker; b holds two workers but has room: b, though it
    holds more workers. With every GPU held, none (Ray places it once one frees up); a dead
    worker's GPU is free again."""
    gpu = Placement(gpus=1.0)
    nodes = [node("a", GPU=1.0), node("b", GPU=4.0)]
    assert spread_node(gpu, nodes, [on("a"), on("b"), on("b")], ONE_GPU) == "b"
    full = [on("a"), *(on("b") for _ in range(4))]
    assert spread_node(gpu, nodes, full, ONE_GPU) is None
    assert spread_node(gpu, nodes, [on("a", WorkerStatus.DEAD), on("b")], ONE_GPU) == "a"
    # Fractions share a device, as many as add up to it (5 x 0.2 sums to a hair under 1).
    for share, n in ((0.5, 2), (0.2, 5), (0.1, 10)):
        frac = {WorkerRole.DECODE: Placement(gpus=share)}
        held = [on("a") for _ in range(n - 1)]
        assert spread_node(Placement(gpus=share), [node("a", GPU=1.0)], held, frac) == "a"
        held.append(on("a"))
        assert spread_node(Placement(gpus=share), [node("a", GPU=1.0)], held, frac) is None
    # Custom resources likewise, whatever the role asking.
    slots = {WorkerRole.DECODE: Placement(resources=(("slot", 1.0),))}
    ask = Placement(resources=(("slot", 1.0),))
    assert spread_node(ask, [node("a", slot=1.0), node("b", slot=2.0)], [on("a")], slots) == "b"


def test_the_nodes_to_avoid_are_taken_only_where_no_other_has_room():
    nodes = [node("a"), node("b"), node("c")]
    assert spread_node(Placement(), nodes, [on("b")], NONE, avoid={"a"}) == "c"
    assert spread_node(Placement(), nodes, [on("b")], NONE, avoid={"a", "c"}) == "b"
    gpu = Placement(gpus=1.0)
    gpus = [node("a", GPU=1.0), node("b", GPU=1.0)]
    assert spread_node(gpu, gpus, [on("b")], ONE_GPU, avoid={"a"}) == "a"  # b is full
    assert spread_node(Placement(), [node("a")], [], NONE, avoid={"a"}) == "a"


def test_a_replacement_keeps_off_the_node_it_hung_on_and_those_its_starts_failed_on(monkeypatch):
    """A worker that hung on b: its replacement avoids b; the start on a fails, the next avoids
    a and b (and is up, on c). A worker that died (not hung) is started again anywhere first."""
    for error, first in ((HUNG, {"b"}), ("RayActorError", set())):
        pools = Pools(PoolConfig(spec=None, restart_backoff_s=0.01))  # type: ignore[arg-type]
        dead = WorkerHandle("decode-0", WorkerRole.DECODE, None, 0, "b", WorkerStatus.DEAD)  # type: ignore[arg-type]
        dead.error = error
        pools.workers["decode-0"] = dead
        avoided: list[set[str]] = []

        def spawn(role, worker_id, incarnation=0, avoid=(), pools=pools, avoided=avoided):
            avoided.append(set(avoid))
            h = WorkerHandle(worker_id, role, None, incarnation, "ac"[len(avoided) - 1])  # type: ignore[arg-type]
            pools.workers[worker_id] = h
            return h

        async def up(h):
            return h.node_id == "c"

        async def nothing(h):
            return None

        monkeypatch.setattr(pools, "_spawn", spawn)
        monkeypatch.setattr(pools, "_engine_up", up)
        monkeypatch.setattr(pools, "_pair_up", nothing)
        monkeypatch.setattr(pools, "_warm", nothing)
        monkeypatch.setattr(pools, "_stop_actor", lambda h, status: setattr(h, "status", status))
        try:
            pools.ops.call(asyncio.wait_for(pools._replace(dead), 10), 15)
        finally:
            pools.ops.stop()
        assert avoided == [first, first | {"a"}]
        assert pools.workers["decode-0"].status is WorkerStatus.READY
        assert pools.workers["decode-0"].incarnation == 2


def test_a_worker_killed_by_rays_memory_monitor_is_dead_at_once():
    """Ray's OutOfMemoryError on a call to a worker: the process that ran it, the actor's own,
    was killed; the worker leaves its pool then, not at the hang timeout."""
    import ray

    pools = Pools(PoolConfig(spec=None, replace_dead=False))  # type: ignore[arg-type]
    h = WorkerHandle("decode-0", WorkerRole.DECODE, None, 0, "a", WorkerStatus.READY)  # type: ignore[arg-type]
    pools.workers["decode-0"] = h
    done: list[str] = []

    async def killed(w):
        done.append(f"kill {w.worker_id}")

    async def forgotten(w):
        done.append(f"forget {w.worker_id}")

    pools._kill = killed  # type: ignore[method-assign]
    pools._forget_dead = forgotten  # type: ignore[method-assign]
    try:
        assert pools.note_failure(h, ray.exceptions.OutOfMemoryError("low on memory"))
        assert h.status is WorkerStatus.DEAD and h.error == "OutOfMemoryError"
        assert pools.dead == ["decode-0"]
        assert not pools.note_failure(h, ValueError("not a death"))
        pools.ops.call(asyncio.sleep(0), 5.0)  # what was submitted before it has run
        assert done == ["kill decode-0", "forget decode-0"]
    finally:
        pools.ops.stop()


def test_a_resize_past_max_workers_is_refused_before_any_worker_starts(monkeypatch):
    pools = Pools(PoolConfig(spec=None, max_workers=4))  # type: ignore[arg-type]
    for i in range(2):
        wid = f"decode-{i}"
        pools.workers[wid] = WorkerHandle(wid, WorkerRole.DECODE, None, 0, "a", WorkerStatus.READY)  # type: ignore[arg-type]
    spawned: list[str] = []
    monkeypatch.setattr(pools, "_spawn", lambda role, wid, *a: spawned.append(wid))
    try:
        with pytest.raises(ValueError, match="5 workers: at most 4"):
            pools.ops.call(Resizes(pools).scale(3, None, None), 10)  # 3 prefill + the 2 decode
        with pytest.raises(ValueError, match="100002 workers: at most 4"):
            pools.ops.call(Resizes(pools).scale(None, None, None, num_both=100000), 10)
        for drain in (float("inf"), float("nan"), -1.0):  # a drain without end holds every resize
            with pytest.raises(ValueError, match="^drain_timeout_s: must be a finite number >= 0"):
                pools.ops.call(Resizes(pools).scale(None, 1, drain), 10)
        assert spawned == []
    finally:
        pools.ops.stop()


class Remote:
    """An actor method stand-in: .remote() gives an awaitable of `value` (or raises it)."""

    def __init__(self, value) -> None:
        self.value = value

    def remote(self):
        async def call():
            if isinstance(self.value, BaseException):
                raise self.value
            return self.value

        return call()


@pytest.mark.parametrize("theirs", ["same", "other", "none"])
def test_a_worker_running_other_code_than_the_router_does_not_start(theirs):
    """Its pickled messages would not read alike on both sides (a request's sampling fields
    shifted): it is refused at start, naming both codes, rather than failing every call."""
    from types import SimpleNamespace

    from worker_protocol.code_id import code_id

    pools = Pools(PoolConfig(spec=None, start_timeout_s=5))  # type: ignore[arg-type]
    import ray

    actor = SimpleNamespace(ready=Remote(SimpleNamespace(node_id="a")))
    if theirs == "none":  # a worker from before the check: Ray's call fails on its side
        missing = AttributeError("'DecodeWorker' object has no attribute 'code_id'")
        actor.code_id = Remote(ray.exceptions.RayTaskError("code_id", "", missing))
    else:
        actor.code_id = Remote(code_id() if theirs == "same" else "0123456789abcdef")
    h = WorkerHandle("decode-0", WorkerRole.DECODE, actor, 0, None)  # type: ignore[arg-type]
    try:
        up = pools.ops.call(pools._engine_up(h), 10)
    finally:
        pools.ops.stop()
    assert up is (theirs == "same"), h.error
    if theirs != "same":
        assert "other pdserve code than the router" in h.error and code_id() in h.error
        assert ("0123456789abcdef" if theirs == "other" else "from before this check") in h.error


class Silent:
    """An actor method stand-in whose call never answers."""

    def remote(self):
        return asyncio.Event().wait()


@pytest.mark.parametrize("theirs", ["other", "before-the-argument"])
def test_a_worker_refusing_the_routers_code_at_start_is_named_as_running_other_code(theirs):
    """It failed its start (Ray's error carries its own): the router says why in one line."""
    from types import SimpleNamespace

    import ray

    from worker_protocol.code_id import code_id

    if theirs == "other":
        said = "OtherCode: pdserve worker code 0123456789abcdef is not the router's (ffff)"
    else:  # its constructor has no router_code
        said = "TypeError: DecodeWorker.__init__() got an unexpected keyword argument 'router_code'"
    raised = ray.exceptions.RayTaskError("DecodeWorker.__init__", f"Traceback ...\n{said}", None)
    died = ray.exceptions.ActorDiedError(cause=raised)
    pools = Pools(PoolConfig(spec=None, start_timeout_s=5))  # type: ignore[arg-type]
    actor = SimpleNamespace(ready=Remote(died))
    h = WorkerHandle("decode-0", WorkerRole.DECODE, actor, 0, None)  # type: ignore[arg-type]
    try:
        assert pools.ops.call(pools._engine_up(h), 10) is False
    finally:
        pools.ops.stop()
    assert h.error.startswith("it runs other pdserve code than the router"), h.error
    assert f"the router's {code_id()}" in h.error and "creation task" not in h.error
    assert ("0123456789abcdef" if theirs == "other" else "from before this check") in h.error


def test_a_worker_silent_on_its_code_is_told_by_the_control_timeout_not_the_start_one():
    """Its engine is up (ready answered): the code-id call waits the control timeout, and the
    error says so, not that the worker was not up within the start timeout for want of
    resources."""
    from types import SimpleNamespace

    pools = Pools(PoolConfig(spec=None, start_timeout_s=300, control_timeout_s=0.2))  # type: ignore[arg-type]
    actor = SimpleNamespace(ready=Remote(SimpleNamespace(node_id="a")), code_id=Silent())
    h = WorkerHandle("decode-0", WorkerRole.DECODE, actor, 0, None)  # type: ignore[arg-type]
    try:
        assert pools.ops.call(pools._engine_up(h), 10) is False
    finally:
        pools.ops.stop()
    assert "did not say which code it runs within 0.2 s" in h.error, h.error
    assert "300" not in h.error and "asks Ray" not in h.error, h.error


def _growing(pools: Pools, where: list[str | None], released: list[asyncio.Event]):
    """A Pools.grow stand-in: the n-th call's workers start on node where[n] (None: no node had
    room), come up once released[n] is set, and are stopped if cancelled before."""
    grown: list[str] = []
    calls = iter(range(len(where)))

    async def grow(counts, new):
        n = next(calls)
        for role, k in counts.items():
            for _ in range(k):
                h = WorkerHandle(pools._new_id(role), role, None, 0, where[n])  # type: ignore[arg-type]
                pools.workers[h.worker_id] = h
                new.append(h)
        try:
            await released[n].wait()
        except asyncio.CancelledError:
            for h in new:
                h.status = WorkerStatus.STOPPED  # as Pools.grow stops the actors it started
                del pools.workers[h.worker_id]
            raise
        for h in new:
            h.status = WorkerStatus.READY
            grown.append(h.worker_id)
        return new

    return grow, grown


@pytest.mark.parametrize("placed", [False, True])
def test_a_resize_waiting_for_room_is_replaced_by_the_next_one(placed):
    """A resize whose new worker has no node with room would hold every later resize until its
    start deadline: the next resize stops it (ResizeReplaced). One whose workers were all placed
    (a model loading) is waited for, and the next one runs after it."""
    pools = Pools(PoolConfig(spec=None))  # type: ignore[arg-type]
    pools.workers["decode-0"] = on("a")
    resizes = Resizes(pools)
    released = [asyncio.Event(), asyncio.Event()]
    grow, grown = _growing(pools, ["a" if placed else None, None], released)
    pools.grow = grow  # type: ignore[method-assign,assignment]
    try:
        first = pools.ops.submit(resizes.scale(1, None, None))
        while not any(h.role is WorkerRole.PREFILL for h in pools.handles()):
            time.sleep(0.01)  # its worker is starting
        second = pools.ops.submit(resizes.scale(1, None, None))
        if placed:
            time.sleep(0.5)
            assert not first.done() and not second.done()  # the second waits its turn
            pools.ops.call(_set(released[0]), 5)
            first.result(5)
            second.result(5)
            assert grown == ["prefill-0"]  # the second found the pool at its size
        else:
            with pytest.raises(ResizeReplaced, match="a later resize replaced this one"):
                first.result(5)
            time.sleep(0.3)
            assert not second.done()  # it adds its own worker, which waits for room in turn
            pools.ops.call(_set(released[1]), 5)
            second.result(5)
            assert grown == ["prefill-1"]
        prefill = [h for h in pools.handles() if h.role is WorkerRole.PREFILL]
        assert [h.status for h in prefill] == [WorkerStatus.READY]
    finally:
        pools.ops.stop()


def test_a_resize_that_comes_to_wait_for_room_is_replaced_by_one_queued_before():
    """Three resizes: the first's worker is placed and loads; the second and third queue behind
    it. The second's worker then waits for room: the third, queued all along, replaces it."""
    pools = Pools(PoolConfig(spec=None))  # type: ignore[arg-type]
    pools.workers["decode-0"] = on("a")
    resizes = Resizes(pools)
    released = [asyncio.Event(), asyncio.Event(), asyncio.Event()]
    grow, grown = _growing(pools, ["a", None, "a"], released)
    pools.grow = grow  # type: ignore[method-assign,assignment]
    try:
        first = pools.ops.submit(resizes.scale(1, None, None))
        while not any(h.role is WorkerRole.PREFILL for h in pools.handles()):
            time.sleep(0.01)
        second = pools.ops.submit(resizes.scale(2, None, None))
        third = pools.ops.submit(resizes.scale(3, None, None))
        time.sleep(0.3)
        pools.ops.call(_set(released[0]), 5)  # the first's worker comes up
        first.result(5)
        with pytest.raises(ResizeReplaced, match="prefill-1 waited for a node with room"):
            second.result(5)
        pools.ops.call(_set(released[2]), 5)
        third.result(5)
        assert grown == ["prefill-0", "prefill-2", "prefill-3"]  # the third adds two
    finally:
        pools.ops.stop()


async def _set(event: asyncio.Event) -> None:
    event.set()


def test_a_start_cancelled_before_it_began_starts_nothing_and_raises():
    """cancel_start() before start() (a Ctrl-C while the server made its pools): the start
    raises at once, spawning no worker."""
    from router.pools import PoolsUnavailable

    pools = Pools(PoolConfig(spec=None))  # type: ignore[arg-type]
    spawned: list[WorkerRole] = []
    pools._spawn = lambda role, *a, **k: spawned.append(role)  # type: ignore[method-assign]
    try:
        pools.cancel_start()
        t0 = time.monotonic()
        with pytest.raises(PoolsUnavailable, match="the start was cancelled"):
            pools.start({WorkerRole.PREFILL: 1, WorkerRole.DECODE: 1})
        assert time.monotonic() - t0 < 5 and not spawned and not pools.handles()
    finally:
        pools.ops.stop()


def _retire_into(pools: Pools, retired: list[tuple[str, bool]]):
    """A stand-in for Pools.retire that records (worker, graceful) and drops the worker."""

    async def retire(h: WorkerHandle, graceful: bool) -> None:
        retired.append((h.worker_id, graceful))
        h.status = WorkerStatus.STOPPED
        pools._drop(h)

    return retire


def test_a_scale_down_stops_a_replacement_still_starting_at_once(monkeypatch):
    """decode-1 died and its replacement is starting (its engine not up) when a resize removes
    one decode worker: the replacement is the one removed, stopped at once without a drain or a
    graceful shutdown call it could not answer, never taken for up (the load poll would have
    called it hung), and the replacement loop starts no other."""
    pools = Pools(PoolConfig(spec=None, restart_backoff_s=0.01))  # type: ignore[arg-type]
    pools.workers["decode-0"] = on("a")
    dead = WorkerHandle("decode-1", WorkerRole.DECODE, None, 0, "a", WorkerStatus.DEAD)  # type: ignore[arg-type]
    pools.workers["decode-1"] = dead
    loading = asyncio.Event()
    spawned: list[WorkerHandle] = []
    seen_up: list[str] = []
    retired: list[tuple[str, bool]] = []

    def spawn(role, worker_id, incarnation=0, avoid=()):
        h = WorkerHandle(worker_id, role, None, incarnation, "a")  # type: ignore[arg-type]
        pools.workers[worker_id] = h
        spawned.append(h)
        return h

    async def engine_up(h):
        while h.status is WorkerStatus.STARTING:  # loads until stopped
            await asyncio.sleep(0.01)
        if h.up:  # as the removal left it: the load poll would call it
            seen_up.append(h.worker_id)
        loading.set()
        return False  # its actor killed under the load

    monkeypatch.setattr(pools, "_spawn", spawn)
    monkeypatch.setattr(pools, "_engine_up", engine_up)
    monkeypatch.setattr(pools, "retire", _retire_into(pools, retired))
    monkeypatch.setattr(pools, "_stop_actor", lambda h, status: setattr(h, "status", status))
    try:
        replacing = pools.ops.submit(pools._replace(dead))
        while not spawned:
            time.sleep(0.01)
        t0 = time.monotonic()
        pools.ops.call(Resizes(pools).scale(None, 1, 60.0), 10)
        assert time.monotonic() - t0 < 5  # not the drain timeout, nor a hang timeout
        replacing.result(5)
        assert loading.is_set()
    finally:
        pools.ops.stop()
    assert retired == [("decode-1", False)]
    assert [h.status for h in spawned] == [WorkerStatus.STOPPED]  # and no second one started
    assert seen_up == []
    assert list(pools.workers) == ["decode-0"]
    assert pools.workers["decode-0"].status is WorkerStatus.READY


def test_a_bounded_wait_cancelled_as_its_call_ends_is_cancelled():
    """The router's bounded wait on a worker's call (router/workers.within): a cancellation
    (the client left) that comes in the same turn of the loop as the call's answer stands.
    Python 3.11's asyncio.wait_for returned the answer then, and the request ran to its end."""
    from router.workers import within

    async def race() -> str:
        answer = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(within(answer, 10))
        await asyncio.sleep(0)  # it waits for the answer
        answer.set_result("tokens")
        waiting.cancel()  # the same turn
        try:
            return await waiting
        except asyncio.CancelledError:
            return "cancelled"

    assert asyncio.run(race()) == "cancelled"

    async def late() -> None:
        await within(asyncio.sleep(5), 0.05)

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(late())


def test_the_router_bounds_its_waits_with_within_not_wait_for():
    """asyncio.wait_for loses such a cancellation on Python 3.11: the router uses none."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "router"
    users = [
        p.name for p in sorted(root.glob("*.py"))
        if "asyncio.wait_for(" in p.read_text() and p.name != "workers.py"
    ]  # fmt: skip
    assert users == []


def test_a_worker_stopped_as_it_starts_is_not_said_to_have_failed_its_start(caplog):
    import logging
    from types import SimpleNamespace

    async def killed():
        raise RuntimeError("The actor died because it was killed by `ray.kill`")

    pools = Pools(PoolConfig(spec=None))  # type: ignore[arg-type]
    actor = SimpleNamespace(ready=SimpleNamespace(remote=killed))
    h = WorkerHandle("decode-1", WorkerRole.DECODE, actor, 1, "a", WorkerStatus.STOPPED)  # type: ignore[arg-type]
    try:
        with caplog.at_level(logging.INFO, "pdserve.pools"):
            assert pools.ops.call(pools._engine_up(h), 10) is False
    finally:
        pools.ops.stop()
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "pdserve.pools"]
    assert said == [(logging.INFO, "worker decode-1 (incarnation 1) stopped as it started")]


def test_a_scale_down_removes_a_dead_worker_waiting_out_its_restart_backoff(monkeypatch):
    """decode-0 is dead and its replacement loop sleeps out a backoff (Ray refused the first
    replacement) when a resize removes one decode worker: the dead one is the one removed (not
    the newest, live and idle decode-1), retired without a graceful call it could not answer,
    and the loop ends after its backoff without starting another."""
    pools = Pools(PoolConfig(spec=None, restart_backoff_s=0.5))  # type: ignore[arg-type]
    dead = WorkerHandle("decode-0", WorkerRole.DECODE, None, 0, "a", WorkerStatus.DEAD)  # type: ignore[arg-type]
    pools.workers["decode-0"] = dead
    pools.workers["decode-1"] = WorkerHandle(
        "decode-1", WorkerRole.DECODE, None, 0, "a", WorkerStatus.READY
    )  # type: ignore[arg-type]
    tries: list[int] = []
    retired: list[tuple[str, bool]] = []

    def spawn(role, worker_id, incarnation=0, avoid=()):
        tries.append(incarnation)
        raise RuntimeError("no node has room")

    monkeypatch.setattr(pools, "_spawn", spawn)
    monkeypatch.setattr(pools, "retire", _retire_into(pools, retired))
    try:
        replacing = pools.ops.submit(pools._replace(dead))
        while not tries:
            time.sleep(0.01)
        pools.ops.call(Resizes(pools).scale(None, 1, 60.0), 10)  # within the 0.5 s backoff
        replacing.result(5)
    finally:
        pools.ops.stop()
    assert tries == [1]  # the loop saw decode-1 removed and tried no more
    assert retired == [("decode-0", False)]
    assert list(pools.workers) == ["decode-1"]
    assert pools.workers["decode-1"].status is WorkerStatus.READY


@pytest.mark.parametrize("status", [WorkerStatus.STARTING, WorkerStatus.STOPPED])
def test_a_failed_warm_up_is_said_unless_a_resize_stopped_the_worker(caplog, status):
    import logging
    from types import SimpleNamespace

    async def killed():
        raise RuntimeError("The actor died because it was killed by `ray.kill`")

    pools = Pools(PoolConfig(spec=None))  # type: ignore[arg-type]
    actor = SimpleNamespace(warmup=SimpleNamespace(remote=killed))
    h = WorkerHandle("both-2", WorkerRole.BOTH, actor, 0, "a", status)  # type: ignore[arg-type]
    try:
        with caplog.at_level(logging.INFO, "pdserve.pools"):
            pools.ops.call(pools._warm(h), 10)  # never raises: the worker serves regardless
    finally:
        pools.ops.stop()
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "pdserve.pools"]
    if status is WorkerStatus.STOPPED:
        assert said == []
    else:
        assert said == [(logging.WARNING, "warm-up of both-2 failed: RuntimeError: The actor "
                         "died because it was killed by `ray.kill`")]  # fmt: skip
