"""`pdserve scale` and `pdserve workers`: the operator's side of pdserve.v1.Admin.

pdserve scale --address 127.0.0.1:50052 --prefill 2 --decode 2   # resize, wait, list
pdserve scale --address 127.0.0.1:50052 --workers 4 --decode 0    # workers doing both
pdserve workers --address 127.0.0.1:50052                         # list
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pdserve_client import ClientAuth
from pdserve_client import add_arguments as add_auth_arguments
from pdserve_client.argtypes import address, integer_in, seconds, seconds_or_zero

ADMIN_PORT = 50052
DEFAULT_ADDRESS = f"127.0.0.1:{ADMIN_PORT}"
ADDRESS_HELP = f"the server's admin host:port (host alone: port {ADMIN_PORT})"


def add_scale_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address", type=address(ADMIN_PORT), default=DEFAULT_ADDRESS, help=ADDRESS_HELP
    )
    size = integer_in(0, 2**31)  # the proto's int32
    p.add_argument("--prefill", type=size, default=None, help="prefill workers wanted (>= 0)")
    p.add_argument("--decode", type=size, default=None, help="decode workers wanted (>= 0)")
    p.add_argument(
        "--workers",
        type=size,
        default=None,
        help="workers that do both wanted (>= 0); at least one worker must decode",
    )
    p.add_argument(
        "--drain-timeout",
        type=seconds_or_zero,
        default=None,
        help="seconds a removed worker may finish its own requests (default: the server's)",
    )
    p.add_argument(
        "--timeout",
        type=seconds,
        default=900.0,
        help="deadline in seconds; a resize still going on then goes on in the server",
    )
    add_auth_arguments(p)


def add_workers_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address", type=address(ADMIN_PORT), default=DEFAULT_ADDRESS, help=ADDRESS_HELP
    )
    p.add_argument("--timeout", type=seconds, default=10.0, help="deadline in seconds")
    add_auth_arguments(p)


def _table(workers: Any) -> str:
    rows = [("worker", "role", "status", "inc", "node", "kv host", "pid", "active")]
    rows += [
        (w.worker_id, w.role, w.status, str(w.incarnation), w.node_ip, w.kv_host, str(w.pid),
         str(w.active_requests))
        for w in workers
    ]  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(n) for c, n in zip(r, widths)).rstrip() for r in rows]
    lines += [f"  {w.worker_id}: {w.error}" for w in workers if w.error]
    return "\n".join(lines)


def _call(args: argparse.Namespace, method: str, request: Any) -> Any:

    from pdserve_proto import admin_pb2_grpc as pb_grpc

    auth = ClientAuth.from_args(args)
    with auth.channel(args.address) as channel:
        stub = pb_grpc.AdminStub(channel)
        return getattr(stub, method)(request, timeout=args.timeout, metadata=auth.metadata)


def _failed(exc: Any, address: str, hint: str = "") -> int:
    if exc.code().name == "UNIMPLEMENTED":  # a server, but not its admin service
        hint = " (is this the admin port? `pdserve serve` prints it: --admin-port, 50052)"
    print(f"error: {address}: {exc.code().name}: {exc.details()}{hint}", file=sys.stderr)
    return 1


def run_scale(args: argparse.Namespace) -> int:
    import grpc

    from pdserve_proto import admin_pb2 as pb

    if args.prefill is None and args.decode is None and args.workers is None:
        print("error: give --prefill, --decode or --workers", file=sys.stderr)
        return 2
    req = pb.ScaleRequest()
    if args.prefill is not None:
        req.prefill = args.prefill
    if args.decode is not None:
        req.decode = args.decode
    if args.workers is not None:
        req.workers = args.workers
    if args.drain_timeout is not None:
        req.drain_timeout_s = args.drain_timeout
    try:
        res = _call(args, "Scale", req)
    except grpc.RpcError as exc:
        going_on = ""
        if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            going_on = (
                f" after {args.timeout:g} s; the resize goes on in the server "
                "(`pdserve workers` shows where it stands)"
            )
        return _failed(exc, args.address, going_on)
    print(_table(res.workers))
    return 0


def run_workers(args: argparse.Namespace) -> int:
    import grpc

    from pdserve_proto import admin_pb2 as pb

    try:
        res = _call(args, "ListWorkers", pb.ListWorkersRequest())
    except grpc.RpcError as exc:
        return _failed(exc, args.address)
    print(_table(res.workers))
    print(
        f"restarts: prefill {res.prefill_restarts}, decode {res.decode_restarts}, "
        f"both {res.both_restarts}"
    )
    if res.HasField("last_scale"):
        print(last_scale(res.last_scale, time.time()))
    return 0


def last_scale(s: Any, now: float) -> str:
    """`pdserve workers`' line for the latest resize (a pb.ScaleOutcome)."""
    if not s.ended_unix:
        return f"last scale: {s.asked}: running for {now - s.started_unix:.0f} s"
    took = s.ended_unix - s.started_unix
    line = f"last scale: {s.asked}: {s.outcome} in {took:.1f} s, {now - s.ended_unix:.0f} s ago"
    return f"{line}: {s.detail}" if s.detail else line
