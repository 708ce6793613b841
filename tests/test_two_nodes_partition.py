"""A node cut off from the cluster under streaming requests (tests/netns.py: the link between the
two namespaces goes down and stays down): what decoded there resumes on the worker of the node
that remains, token for token; the router stops the cut-off worker after --worker-hang-timeout
(before Ray declares the node dead), its replacement starts on the node that remains at once
(a hung worker's is placed on another node with room: Pools._replace), and every pool is full
again. A cluster of its own: the cut leaves the second node dead.
"""

from __future__ import annotations

import json

import pytest

from tests import netns
from tests.helpers import hf_greedy, random_prompts
from tests.test_two_nodes import serve_and_probe

why_not = netns.available()
pytestmark = pytest.mark.skipif(why_not is not None, reason=f"two-node test: {why_not}")

MODEL = "tiny-llama"  # as serve_and_probe starts it
MAX_NEW = 300
HANG_S = 5.0


@pytest.mark.timeout(420)
def test_a_node_cut_off_under_streams_loses_none_of_them(tmp_path):
    prompts = random_prompts([19, 26, 31, 22], seed=94)
    with netns.TwoNodes() as nodes:
        cut = ["ip", "link", "set", nodes.veth[0], "down"]  # from the head's side
        seen = serve_and_probe(
            nodes,
            tmp_path,
            ["--prefill", "0", "--decode", "2", "--worker-hang-timeout", str(HANG_S)],
            prompts,
            probe_flags=("--max-tokens", str(MAX_NEW), "--cut", json.dumps(cut)),
            probe="partition_probe.py",
        )
    text = seen["log"]
    where = {w["id"]: w["node_ip"] for w in seen["workers"]}
    [on_a] = [w for w, ip in where.items() if ip == netns.HEAD_IP]
    [on_b] = [w for w, ip in where.items() if ip == netns.NODE_IP]
    assert not seen["errors"], (seen["errors"], text[-3000:])
    for prompt, toks, cut_at, final in zip(prompts, seen["tokens"], seen["cut_at"], seen["finals"]):
        assert toks == hf_greedy(MODEL, prompt, MAX_NEW)
        assert cut_at < MAX_NEW - 50  # cut mid-stream
        assert final["decode_worker"] == on_a  # every one ended on the node that remains
    m = seen["metrics"]
    # The router places colocated streams on the least loaded worker: half of them were on the
    # node cut off, and resumed.
    assert m["pdserve_requests_resumed_total"] == len(prompts) // 2, text[-3000:]
    assert m[f"pdserve_worker_failures_total{{role=decode,worker={on_b}}}"] == 1
    # The router's watchdog stopped it, not Ray declaring its node dead (which comes later).
    assert f"worker {on_b} gave no load for" in text, text[-3000:]
    assert m[f"pdserve_worker_hangs_total{{role=decode,worker={on_b}}}"] == 1
    # Its replacement started on the node that remains, not first on the node cut off (which
    # holds the fewest workers, and which Ray lists as alive until it declares it dead, a minute
    # and more later), takes load there, and every worker's KV blocks are free again.
    assert f"starting {on_b} (incarnation 1) on {netns.HEAD_IP}" in text, text[-3000:]
    assert f"starting {on_b} (incarnation 1) on {netns.NODE_IP}" not in text, text[-3000:]
    after = sorted((w["id"], w["status"], w["node_ip"]) for w in seen["after"])
    assert after == sorted([(on_a, "ready", netns.HEAD_IP), (on_b, "ready", netns.HEAD_IP)])
    usage = {k: v for k, v in m.items() if k.startswith("pdserve_worker_kv_cache_usage_ratio")}
    assert len(usage) == 2 and not any(usage.values()), usage
