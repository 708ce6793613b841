"""Waiting, bounded, for a KV transfer to end: both sides of a handoff do it (the sender for its
send, the receiver for its receive)."""

from __future__ import annotations

import asyncio
import time

from kv_transfer import TransferStatus
from kv_transfer.torch_dist import TorchDistConnector


async def wait_transfer(
    connector: TorchDistConnector, rid: str, timeout_s: float
) -> TransferStatus:
    """Poll `rid` until it ends or `timeout_s` passes; one still running then is aborted. The
    status it ended with (its record stays: the caller reads or releases it)."""
    deadline = time.monotonic() + timeout_s
    status = connector.poll(rid)
    while not status.finished and time.monotonic() < deadline:
        await asyncio.sleep(0.002)
        status = connector.poll(rid)
    if not status.finished:
        connector.abort(rid)
        status = connector.poll(rid)
    return status
