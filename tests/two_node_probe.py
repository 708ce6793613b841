"""Run inside a network namespace next to a `pdserve serve` (tests/test_two_nodes.py): wait for
the server, list its workers, send requests, read its metrics, and print what happened as one
JSON object. The test outside the namespace asserts on it.

    python tests/two_node_probe.py --host 10.77.0.1 --prompts '[[1, 2, 3], [4, 5]]' ...
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve_proto import admin_pb2, admin_pb2_grpc
from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc


def wait_ready(address: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with grpc.insecure_channel(address) as ch:
                pb_grpc.GenerationStub(ch).Info(pb.InfoRequest(), timeout=2)
            return
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def one(address: str, prompt: list[int], max_tokens: int, path: int) -> dict:
    req = pb.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        path=path,
    )
    t0 = time.monotonic()
    with grpc.insecure_channel(address) as ch:
        res = pb_grpc.GenerationStub(ch).Complete(req, timeout=120)
    f = res.final
    return {
        "tokens": list(res.token_ids),
        "path": pb.Path.Name(f.path),
        "kv_fallback": f.kv_fallback,
        "ttft_ms": f.ttft_ms,
        "prefill_worker": f.prefill_worker,
        "decode_worker": f.decode_worker,
        "wall_s": time.monotonic() - t0,
    }


def workers(admin_address: str) -> list[dict]:
    """The server's workers as its admin service lists them."""
    with grpc.insecure_channel(admin_address) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        listed = stub.ListWorkers(admin_pb2.ListWorkersRequest(), timeout=10)
    return [
        {"id": w.worker_id, "role": w.role, "status": w.status, "node_ip": w.node_ip,
         "kv_host": w.kv_host}
        for w in listed.workers
    ]  # fmt: skip


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def parser(max_tokens: int) -> argparse.ArgumentParser:
    """The arguments every probe takes: where the server is, and what to send."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, default=50051)
    ap.add_argument("--admin-port", type=int, default=50052)
    ap.add_argument("--metrics-port", type=int, default=9400)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--wait", type=float, default=240.0, help="for the server to be ready")
    return ap


def main() -> int:
    ap = parser(max_tokens=8)
    ap.add_argument("--path", default="PATH_DISAGGREGATED")
    ap.add_argument(
        "--again-after", type=float, default=None, help="send the prompts again after S seconds"
    )
    args = ap.parse_args()
    address = f"{args.host}:{args.port}"
    t0 = time.monotonic()
    wait_ready(address, args.wait)
    ready_s = time.monotonic() - t0
    listed = workers(f"127.0.0.1:{args.admin_port}")  # as an operator on the head
    prompts = json.loads(args.prompts)
    path = pb.Path.Value(args.path)
    # The first alone (what a first request sees), the rest together.
    results = [one(address, prompts[0], args.max_tokens, path)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results += list(pool.map(lambda p: one(address, p, args.max_tokens, path), prompts[1:]))
    again = []
    if args.again_after is not None:
        time.sleep(args.again_after)
        with ThreadPoolExecutor(len(prompts)) as pool:
            again = list(pool.map(lambda p: one(address, p, args.max_tokens, path), prompts))
    out = {
        "again": again,
        "ready_s": ready_s,
        "workers": listed,
        "results": results,
        "metrics": metrics(f"http://{args.host}:{args.metrics_port}/metrics"),
    }
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
