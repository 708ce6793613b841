"""Which code a process speaks to its peers with: a digest of the modules whose types and
constants cross between the router and its workers (pickled by Ray) and between two workers
(the KV transfer's wire), computed alike on every side. A worker whose digest differs from the
router's (a node left on an older version, an upgrade half done) is refused at start, naming
both (router/pools.py), rather than failing every request it is handed: a message pickled by
one version reads shifted in another.

Only these modules count: a change elsewhere (the router's own code, a file left behind by a
sync that deletes nothing) refuses no worker."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path

BOUNDARY = (
    "engine.config", "engine.device_rate", "engine.errors", "engine.outputs",
    "engine.sampling_params", "engine.seen", "kv_transfer.base", "kv_transfer.faults",
    "kv_transfer.layout", "kv_transfer.wire", "worker_protocol.messages",
)  # fmt: skip


@functools.cache
def code_id() -> str:
    """16 hex digits of the SHA-256 of BOUNDARY's source files (each named by its module), read
    once per process."""
    digest = hashlib.sha256()
    for name in BOUNDARY:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ImportError(f"{name}: not found")
        digest.update(name.encode() + b"\0" + Path(spec.origin).read_bytes() + b"\0")
    return digest.hexdigest()[:16]
