"""TTFT across two Ray nodes on distinct addresses (tests/netns.py: two network namespaces on this
machine joined by a veth pair; as root): the default model, the prefill worker on one node and the
decode worker on the other, four 512-token prompts on each path (the first alone, then three
together), and the KV bytes that crossed. Prints one line per path.

    sudo .venv/bin/python scripts/two_node_ttft.py
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import netns  # noqa: E402
from tests.helpers import random_prompts  # noqa: E402


def main() -> int:
    argparse.ArgumentParser(description=__doc__).parse_args()  # --help, and nothing else
    # SIGTERM (`timeout`, a supervisor) leaves as Ctrl-C does: the namespaces and their Ray
    # processes are removed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why_not = netns.available()
    if why_not:
        print(f"cannot run: {why_not}", file=sys.stderr)
        return 1
    prompts = random_prompts([512] * 4, vocab=20000, seed=5)
    seen = {}
    with netns.TwoNodes() as n:
        for path in ("PATH_DISAGGREGATED", "PATH_COLOCATED"):
            log = Path(f"/tmp/pdserve-two-node-{path.lower()}.log")
            server = n.start(
                0,
                [sys.executable, "-m", "router.cli", "serve", "--model", "smollm2-135m",
                 "--ray-address", n.head_address, "--host", netns.HEAD_IP, "--kv-cache-gib",
                 "0.5", "--prefill-resources", '{"node_a": 1}', "--decode-resources",
                 '{"node_b": 1}'],
                log,
                env=n.head_env,
            )  # fmt: skip
            try:
                out = n.run(
                    0,
                    [sys.executable, str(ROOT / "tests" / "two_node_probe.py"), "--host",
                     netns.HEAD_IP, "--prompts", json.dumps(prompts), "--max-tokens", "16",
                     "--path", path],
                    timeout=600,
                )  # fmt: skip
                seen[path] = json.loads(out.stdout)
            finally:
                netns.stop(server)
    for path, s in seen.items():
        m = s["metrics"]
        ttft = [round(r["ttft_ms"]) for r in s["results"]]
        falls = sum(bool(r["kv_fallback"]) for r in s["results"])
        nodes = {w["id"]: w["node_ip"] for w in s["workers"]}
        print(f"{path}: TTFT ms {ttft} (first alone, then 3 together); fallbacks {falls}; "
              f"KV {m['pdserve_kv_transfer_bytes_total'] / 1e6:.1f} MB in "
              f"{m['pdserve_kv_transfers_total']:.0f} transfers; workers {nodes}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
