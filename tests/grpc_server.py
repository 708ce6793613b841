"""A pdserve server running on its own event-loop thread, for tests that talk to it over gRPC
from the main thread with the blocking client."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from router.cluster import ClusterConfig
from router.ray_runtime import init_ray
from router.serve_config import ServeConfig
from router.server import Server

T = TypeVar("T")


class ServerThread:
    def __init__(self, config: ServeConfig, **kwargs: Any) -> None:
        if "backend" not in kwargs:
            # Ray's own processes die with the thread that started them (PR_SET_PDEATHSIG):
            # start it here, on the long-lived main thread, not on the server's loop thread.
            init_ray(config.cluster.address)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server = Server(config, **kwargs)
        self.run(self.server.start(), timeout=300)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        """Run `coro` on the server's loop and wait (bounded) for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def address(self) -> str:
        return self.server.address

    def close(self) -> None:
        try:
            self.run(self.server.stop(), timeout=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


def tiny_config(
    num_prefill: int = 1, num_decode: int = 1, batched_tokens: int = 32, **serve: Any
) -> ServeConfig:
    """A server on 127.0.0.1 (any free ports) over Ray workers running tiny-llama."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from router.cluster import ClusterConfig

    engine = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=batched_tokens, max_num_seqs=16),
    )
    cluster = ClusterConfig(
        model="tiny-llama",
        num_prefill=num_prefill,
        num_decode=num_decode,
        engine=engine,
        kv_transfer_deadline_s=10,
    )
    return ServeConfig(**{"cluster": cluster, "port": 0, "drain_timeout_s": 5, **serve})


# A tiny model's engine as the Ray-backed server tests run it: 4-token blocks, 32-token steps.
TINY_ENGINE = EngineConfig(
    cache=CacheConfig(block_size=4, num_blocks=512),
    scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=16),
)


def tiny_server(cluster: ClusterConfig) -> ServerThread:
    """A server over `cluster` on ephemeral gRPC and metrics ports, draining for 5 s."""
    return ServerThread(ServeConfig(cluster=cluster, port=0, metrics_port=0, drain_timeout_s=5))


def decoding(srv: ServerThread, rid: str) -> str | None:
    """The worker the router's books say is decoding `rid` (read on the server's loop, which
    changes them)."""
    return _booked(srv, rid, "_decodes")


def prefilling(srv: ServerThread, rid: str) -> str | None:
    """The worker the router's books say is prefilling `rid` (as `decoding`)."""
    return _booked(srv, rid, "_prefills")


def _booked(srv: ServerThread, rid: str, books: str) -> str | None:
    async def find() -> str | None:
        for w, state in srv.server.core.states.items():
            if any(k.startswith(rid + "#") for k in getattr(state, books)):
                return w
        return None

    return srv.run(find())


@contextlib.contextmanager
def paced_steps(actors: list[Any], seconds: float) -> Iterator[None]:
    """Within the block, every engine step of the workers behind `actors` waits `seconds`
    first: a stream that a test acts on mid-way lasts long enough for the act however fast the
    host (600 tokens of a tiny model take about a second). Workers still alive after it are as
    they were; a dead one needs nothing."""
    import ray

    def pace(worker: Any, seconds: float) -> None:  # in the actor (a closure: sent by value)
        import time

        engine = worker.engine
        engine.__dict__.pop("step", None)  # the class's own step again
        if seconds > 0:
            step = engine.step

            def paced(*args: Any, **kwargs: Any) -> Any:
                time.sleep(seconds)
                return step(*args, **kwargs)

            engine.step = paced

    ray.get([a.__ray_call__.remote(pace, seconds) for a in actors], timeout=30)
    try:
        yield
    finally:
        for a in actors:
            with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                ray.get(a.__ray_call__.remote(pace, 0.0), timeout=30)
