"""`pdserve serve`'s process: the server runs until SIGINT or SIGTERM, then drains and stops.

A first signal drains (router/server.py: Server.stop); one within AGAIN_AFTER_S of it is the same
stop passed on by a wrapper, and the drain goes on; a later one ends the requests in flight now
(Server.hurry). A signal during the start stops the workers started so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

from router.client_limit import raise_file_limit
from router.pools import PoolsUnavailable
from router.ray_runtime import init_ray
from router.serve_config import ServeConfig, model_tokenizer
from router.server import Server

log = logging.getLogger("pdserve.server")
# A second SIGINT/SIGTERM this soon after the first is the same one passed on, not "again".
AGAIN_AFTER_S = 1.0


async def serve(config: ServeConfig) -> None:
    """Run until SIGINT or SIGTERM, then drain and stop."""
    raise_file_limit()
    # The model first: one that is not there stops the start before Ray and any worker.
    server = Server(config, tokenizer=await asyncio.to_thread(model_tokenizer, config))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Ray installs its own SIGTERM handler (exit at once) when it starts: start it first, then
    # take the signals over, so that SIGTERM drains like SIGINT.
    init_ray(config.cluster.address)

    first: list[float] = []  # when the first signal came

    def on_signal() -> None:
        if not stop.is_set():
            first.append(time.monotonic())
            stop.set()
        elif time.monotonic() - first[0] < AGAIN_AFTER_S:
            # The same stop sent twice: a wrapper (`timeout`, a shell script) passing on the
            # Ctrl-C or SIGTERM its process group got too. It drains.
            log.info("a second signal within %.0f s of the first: draining still", AGAIN_AFTER_S)
        else:  # a second one while draining
            log.warning("interrupted again: the requests still in flight end now")
            server.hurry()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    starting = asyncio.ensure_future(server.start())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # a start waits for its workers (up to --start-timeout)
            log.warning("interrupted during the start: stopping the workers started so far")
            server.cancel_start()
            with contextlib.suppress(PoolsUnavailable):
                await starting
        else:
            starting.result()  # what stopped the start, if it did
            await stop.wait()
            log.info(
                "shutting down: draining in-flight requests (up to %.0f s; interrupt again to "
                "end them now)",
                config.drain_timeout_s,
            )
    finally:
        stopping.cancel()
        with contextlib.suppress(Exception):
            await server.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    log.info("stopped")
