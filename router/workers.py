"""The router's handles on its worker actors, how the actors are placed on Ray nodes, and the
supervisor loop that starts, replaces and stops them.

A worker id ("prefill-0", "decode-1") names a place in a pool; the actor behind it may change.
Each actor under an id is one incarnation (0 for the first, +1 for each replacement):

  STARTING -> READY -> DRAINING -> STOPPED     (removed by a resize)
                 \\-> DEAD                      (found dead; a new incarnation is STARTING)

Only READY workers take new requests. A STARTING worker becomes READY once its engine is up,
its KV pairs with the other pool's READY workers are made, and it has run a warm-up request.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from worker_protocol.messages import WorkerInfo, WorkerRole

T = TypeVar("T")
RESOURCE_STEP = 1e-4  # the smallest amount of a resource Ray tells apart


class WorkerStatus(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class Placement:
    """What each worker of one pool asks Ray for."""

    gpus: float = 0.0  # GPUs per worker; fractions share a device
    resources: tuple[tuple[str, float], ...] = ()  # custom resources, e.g. (("prefill_node", 1),)

    def actor_options(self, node_id: str | None = None) -> dict[str, Any]:
        """Ray options for one worker; `node_id` is the node it must go to (spread_node chose
        it among those whose resources fit). A hard affinity: Ray's soft one moves zero-CPU
        actors to another node even when the chosen one is idle."""
        # CPU workers take no Ray CPU slot: each sets its own torch thread count instead, and a
        # slot per actor would starve later tasks on a small machine.
        opts: dict[str, Any] = {"num_cpus": 0, "num_gpus": self.gpus, "max_concurrency": 1000}
        if self.resources:
            opts["resources"] = dict(self.resources)
        if node_id is not None:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return opts

    def fits(self, node: dict[str, Any], taken: dict[str, float] | None = None) -> bool:
        """Whether a live node (an entry of `ray.nodes()`) has what one worker asks for, less
        what `taken` (by resource) is asked there already."""
        if not node.get("Alive", False):
            return False
        have, taken = node.get("Resources", {}), taken or {}
        asks = (("GPU", self.gpus), *self.resources)
        # Ray counts resources in steps of 1e-4: sums of fractions (5 x 0.2 GPU) land on them.
        return all(
            have.get(k, 0.0) - taken.get(k, 0.0) >= v - RESOURCE_STEP / 2 for k, v in asks if v > 0
        )

    def asks(self) -> dict[str, float]:
        """What one worker takes of a node's resources."""
        return {"GPU": self.gpus, **dict(self.resources)}

    def describe(self) -> str:
        parts = [f"{self.gpus:g} GPU"] + [f"{v:g} {k}" for k, v in self.resources]
        return ", ".join(parts)


@dataclass(slots=True, eq=False)
class WorkerHandle:
    """One incarnation of a worker: its actor, what it said about itself once ready, and the
    requests the cluster has running on it."""

    worker_id: str
    role: WorkerRole
    actor: ActorHandle
    incarnation: int
    node_id: str | None = None  # the Ray node it was sent to (None: where Ray chose)
    status: WorkerStatus = WorkerStatus.STARTING
    info: WorkerInfo | None = None  # once its engine is up
    active: int = 0  # requests using it now (as prefill or decode worker)
    started_at: float = field(default_factory=time.monotonic)
    error: str = ""  # why it died or could not start
    answered_at: float = 0.0  # when it last answered a load call or a ping (time.monotonic)

    @property
    def ready(self) -> bool:
        return self.status is WorkerStatus.READY

    @property
    def up(self) -> bool:
        """Its engine up and not stopped: taking requests (READY) or finishing its own
        (DRAINING)."""
        return self.status in (WorkerStatus.READY, WorkerStatus.DRAINING)

    def is_actor(self, actor_id: str | None) -> bool:
        """Whether a Ray error naming `actor_id` is about this incarnation (None: unknown)."""
        if actor_id is None or self.info is None or not self.info.actor_id:
            return True
        return actor_id == self.info.actor_id


class LoopThread:
    """An event loop on a daemon thread: the supervisor loop. Work that outlives the request that
    set it off (pairing, replacing a dead worker, draining) runs here, whichever loop asked."""

    def __init__(self, name: str = "pdserve-supervisor") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on the supervisor loop from any other loop. A caller that stops waiting
        (a client's deadline) does not stop `coro`: membership changes run to the end."""
        if asyncio.get_running_loop() is self.loop:
            return await coro
        return await asyncio.shield(asyncio.wrap_future(self.submit(coro)))

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the supervisor loop from a thread with no loop of its own."""
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        """Cancel what still runs here, let it unwind (bounded), then end the thread."""

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=5)

        if self.loop.is_running():
            try:
                self.submit(cancel_all()).result(10)
            except Exception:
                pass  # stopping regardless
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


def spread_node(
    placement: Placement,
    nodes: list[dict[str, Any]],
    handles: list[WorkerHandle],
    placements: Mapping[WorkerRole, Placement],
    avoid: Collection[str] = (),
) -> str | None:
    """The node a new worker should go to so that the pools spread over the nodes: among the
    nodes with room for it, the one holding the fewest workers (any role), then the lowest node
    id; none of `avoid` (where the worker hung, or a start of it failed) while another has
    room. Room is what a node has less what the workers of these pools there, not dead or
    stopped, ask for (`placements`, by role): a node whose GPUs the pools hold takes no more
    (what else runs on the cluster is not counted). Draining workers hold their room but are
    not counted among a node's workers: they are leaving. With no node with room, None: Ray
    places it once one frees up. Ray's SPREAD strategy does not spread actors that ask for no CPU or
    GPU, and placing by hand also lets the count include workers still starting."""
    live = [h for h in handles if h.status not in (WorkerStatus.DEAD, WorkerStatus.STOPPED)]
    taken: dict[str, dict[str, float]] = {}
    for h in live:
        if h.node_id is not None:
            on_node = taken.setdefault(h.node_id, {})
            for k, v in placements.get(h.role, Placement()).asks().items():
                on_node[k] = on_node.get(k, 0.0) + v
    fitting = [n["NodeID"] for n in nodes if placement.fits(n, taken.get(n["NodeID"]))]
    if not fitting:
        return None

    staying = [h for h in live if h.status is not WorkerStatus.DRAINING]

    def load(node_id: str) -> tuple[bool, int, str]:
        return node_id in avoid, sum(h.node_id == node_id for h in staying), node_id

    return min(fitting, key=load)


def order(worker_id: str) -> int:
    """A worker's number within its pool ("decode-3": 3; 0 for an id without one)."""
    try:
        return int(worker_id.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 0


async def done_unless(task: asyncio.Future[Any], stop: Callable[[], bool], every_s: float) -> bool:
    """Wait for `task`, looking every `every_s` whether `stop()` holds: True once it is done,
    False where stop() held first (it still runs: the caller decides what becomes of it)."""
    while not task.done():
        await asyncio.wait({task}, timeout=every_s)
        if not task.done() and stop():
            return False
    return True


async def within(aw: Awaitable[T], timeout_s: float) -> T:
    """`await aw`, bounded: asyncio.TimeoutError past `timeout_s` (`aw` cancelled), as
    asyncio.wait_for; but a cancellation that comes as `aw` ends is never lost. Python 3.11's
    wait_for returns `aw`'s result then, and the cancelled task runs on: a request whose
    client left went on to its last token."""
    async with asyncio.timeout(timeout_s):
        return await aw
