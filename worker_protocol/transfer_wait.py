"""Waiting, bounded, for a KV transfer to end: both sides of a handoff do it (the sender for its
send, the receiver for its receive)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kv_transfer import TransferStatus
from kv_transfer.torch_dist import TorchDistConnector


async def wait_transfer(
    connector: TorchDistConnector,
    rid: str,
    timeout_s: float,
    ended: Callable[[], bool] = lambda: False,
) -> TransferStatus:
    """Poll `rid` until it ends or `timeout_s` passes; one still running then is aborted. The
    status it ended with (its record stays: the caller reads or releases it). FAILED, unpolled,
    once `ended()` is true: something else (an abort) is ending the transfer, and releases its
    record (a poll may no longer find it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if ended():
            return TransferStatus.FAILED
        status = connector.poll(rid)
        if status.finished or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.002)
    if not status.finished:
        # Off the event loop: ending a transfer waits for its lane (up to its I/O timeout on a
        # stuck link), and the worker's other requests keep streaming meanwhile.
        await asyncio.to_thread(connector.abort, rid)
        if ended():  # ended elsewhere meanwhile, which releases its record
            return TransferStatus.FAILED
        status = connector.poll(rid)
    return status
