"""Which code a process speaks to its peers with: a digest of the modules whose types and
constants cross between the router and its workers (pickled by Ray) and between two workers
(the KV transfer's wire), computed alike on every side. A worker whose digest differs from the
router's (a node left on an older version, an upgrade half done) is refused at start, naming
both (router/worker_starts.py), rather than failing every request it is handed: a message pickled by
one version reads shifted in another. The router hands its digest to each worker it starts,
which refuses itself before loading its model (`refuse_other_code`); a worker from before that
argument is refused by Ray (an unexpected keyword), and the router asks every worker whose
engine is up for its digest as well.

Only these modules count: a change elsewhere (the router's own code, a file left behind by a
sync that deletes nothing) refuses no worker."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import re
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


ROUTER_CODE_ARG = "router_code"  # the workers' constructor argument the router's digest comes in
_REFUSAL = re.compile(r"pdserve worker code ([0-9a-f]+) is not the router's")


class OtherCode(RuntimeError):
    """A worker started by a router that runs other code (see the module docstring)."""


def refuse_other_code(router_code: str | None) -> None:
    """OtherCode unless `router_code` (None: not given) is this process's code."""
    if router_code is not None and router_code != code_id():
        raise OtherCode(f"pdserve worker code {code_id()} is not the router's ({router_code})")


def other_code(theirs: str | None) -> str:
    """Why a worker running `theirs` (None: a version from before the check) cannot serve."""
    said = theirs or "a version from before this check"
    return (
        f"it runs other pdserve code than the router (worker_protocol/code_id.py: its {said}, "
        f"the router's {code_id()}): install one version on every node"
    )


def refused_at_start(error: str) -> str | None:
    """`other_code`'s reason where a worker's start failed (`error`, Ray's text of it) for
    running other code than the router; None for any other failure."""
    found = _REFUSAL.search(error)
    if found is not None:
        return other_code(found.group(1))
    if f"unexpected keyword argument '{ROUTER_CODE_ARG}'" in error:
        return other_code(None)
    return None
