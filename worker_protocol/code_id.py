"""Which code a process runs: a digest of the source files of pdserve's packages, computed alike
by the router and by each worker. The router and its workers exchange pickled messages whose
fields must read alike on both sides; a worker whose code differs from the router's (a node
left on an older version, an upgrade half done) is refused at start, naming both
(router/pools.py), rather than failing every request it is handed."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

PACKAGES = (
    "engine", "worker_protocol", "kv_transfer", "prefill_worker", "decode_worker", "both_worker",
    "router", "pdserve_proto",
)  # fmt: skip


@functools.cache
def code_id() -> str:
    """16 hex digits of the SHA-256 of every .py file of PACKAGES (path and content), read
    once per process."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
