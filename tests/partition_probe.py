"""Run inside the head node's network namespace next to a `pdserve serve`
(tests/test_two_nodes_partition.py): open streams, and once every one has tokens, note where they
decode and run the command that cuts the nodes apart; then wait for every stream to end, and for
the pools to be whole again, and print what happened as one JSON object.

    python tests/partition_probe.py --host 10.77.0.1 --prompts '[[1, 2], [3, 4]]' \\
        --cut '["ip", "link", "set", "veth0", "down"]'
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import grpc

from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc
from tests.two_node_probe import metrics, parser, wait_ready, workers


def usages(url: str) -> dict[str, float]:
    """The KV cache usage of every worker the router polls, by worker."""
    key = "pdserve_worker_kv_cache_usage_ratio{"
    return {k: v for k, v in metrics(url).items() if k.startswith(key)}


def main() -> int:
    ap = parser(max_tokens=300)
    ap.add_argument("--cut", required=True, help="JSON argv of the command that cuts the link")
    args = ap.parse_args()
    address = f"{args.host}:{args.port}"
    url = f"http://{args.host}:{args.metrics_port}/metrics"
    wait_ready(address, args.wait)
    listed = workers(f"127.0.0.1:{args.admin_port}")  # as an operator on the head
    prompts = json.loads(args.prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    finals: list[dict] = [{} for _ in prompts]
    errors: list[str] = []

    def stream(i: int) -> None:
        req = pb.GenerateRequest(
            prompt_token_ids=prompts[i],
            sampling=pb.SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
            path=pb.PATH_COLOCATED,
        )
        try:
            with grpc.insecure_channel(address) as ch:
                for msg in pb_grpc.GenerationStub(ch).Generate(req, timeout=180):
                    tokens[i].extend(msg.token_ids)
                    if msg.HasField("final"):
                        finals[i] = {"decode_worker": msg.final.decode_worker}
        except grpc.RpcError as exc:
            errors.append(f"{exc.code().name}: {exc.details()}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not all(len(t) >= 3 for t in tokens) and not errors:
        if time.monotonic() > deadline:
            errors.append("the streams did not start")
            break
        time.sleep(0.02)
    cut_at = [len(t) for t in tokens]
    t0 = time.monotonic()
    subprocess.run(json.loads(args.cut), check=True, timeout=30)
    for t in threads:
        t.join(200)
    ended_s = time.monotonic() - t0
    # Then the pools as they stand once every worker is ready again and every worker's KV
    # blocks are free, as the router's polls see them (or at the deadline: the test then says
    # what is missing).
    deadline = time.monotonic() + 120
    while True:
        after = workers(f"127.0.0.1:{args.admin_port}")  # as an operator on the head
        ready = [w for w in after if w["status"] == "ready"]
        usage = usages(url)
        if len(ready) == len(listed) and len(usage) == len(listed) and not any(usage.values()):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    out = {
        "workers": listed,
        "tokens": tokens,
        "finals": finals,
        "errors": errors,
        "cut_at": cut_at,
        "ended_after_cut_s": ended_s,
        "after": after,
        "metrics": metrics(url),
    }
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
