"""pdserve on two Ray nodes with distinct addresses (tests/netns.py): the prefill pool on one node,
the decode pool on the other, as a user deploys it, with `pdserve serve --ray-address HEAD:6379`.

  - the KV of disaggregated requests crosses the nodes: bytes counted, nothing falls back, the
    first token comes within seconds, and greedy output equals transformers';
  - with the KV transfer told to listen on each node's loopback (the mistake a cluster makes when
    every worker binds 127.0.0.1), the pair cannot connect: that costs one bounded wait at the
    start, and every request then prefills on its decode worker at once, counted in
    pdserve_local_prefill_fallbacks_total and said in FinalInfo.kv_fallback;
  - without placement flags the workers spread over both nodes (and `--ray-address auto` on the
    head node finds its cluster).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import netns
from tests.helpers import hf_greedy, random_prompts

why_not = netns.available()
pytestmark = pytest.mark.skipif(why_not is not None, reason=f"two-node test: {why_not}")

MODEL = "tiny-llama"
MAX_NEW = 8
PAIR_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def nodes():
    with netns.TwoNodes() as n:
        yield n


def serve_and_probe(
    nodes,
    tmp_path: Path,
    flags: list[str],
    prompts: list[list[int]],
    address: str | None = None,
    probe_flags: tuple[str, ...] = (),
    probe: str = "two_node_probe.py",
) -> dict:
    """Start `pdserve serve` on the head node's namespace with `flags` (joining the cluster at
    `address`, by default the head's HOST:PORT), run the probe (a script in tests/) there, stop
    the server (SIGINT), and return what the probe saw plus the server's log."""
    serve = [
        sys.executable, "-m", "router.cli", "serve", "--model", MODEL,
        "--ray-address", address or nodes.head_address, "--host", netns.HEAD_IP,
        "--kv-cache-gib", "0.05", "--pair-timeout", str(PAIR_TIMEOUT_S), *flags,
    ]  # fmt: skip
    log = tmp_path / "serve.log"
    server = nodes.start(0, serve, log, env=nodes.head_env)
    try:
        probe = nodes.run(
            0,
            [sys.executable, str(netns.ROOT / "tests" / probe), "--host",
             netns.HEAD_IP, "--prompts", json.dumps(prompts), "--max-tokens", str(MAX_NEW),
             *probe_flags],
            timeout=300,
        )  # fmt: skip
        seen = json.loads(probe.stdout)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        raise AssertionError(f"{exc}\n--- server log ---\n{log.read_text()[-4000:]}") from None
    finally:
        netns.stop(server)
    seen["log"] = log.read_text()
    return seen


def by_role(seen: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"prefill": [], "decode": []}
    for w in seen["workers"]:
        out[w["role"]].append(w)
    return out


@pytest.mark.timeout(420)
def test_kv_crosses_nodes_with_prefill_on_one_and_decode_on_the_other(nodes, tmp_path):
    prompts = random_prompts([21, 40, 13, 33, 57], seed=91)
    seen = serve_and_probe(
        nodes,
        tmp_path,
        ["--prefill", "1", "--decode", "1", "--prefill-resources", '{"node_a": 1}',
         "--decode-resources", '{"node_b": 1}'],
        prompts,
    )  # fmt: skip
    workers = by_role(seen)
    # Placed where the flags say, each listening on its own node's address.
    assert [w["node_ip"] for w in workers["prefill"]] == [netns.HEAD_IP], seen["workers"]
    assert [w["node_ip"] for w in workers["decode"]] == [netns.NODE_IP], seen["workers"]
    assert all(w["kv_host"] == w["node_ip"] for w in seen["workers"])
    m = seen["metrics"]
    for prompt, r in zip(prompts, seen["results"]):
        assert r["tokens"] == hf_greedy(MODEL, prompt, MAX_NEW)
        assert r["path"] == "PATH_DISAGGREGATED" and r["kv_fallback"] == ""
        assert r["prefill_worker"] == "prefill-0" and r["decode_worker"] == "decode-0"
        assert r["ttft_ms"] < 5000, r  # no pairing timeout on the way
    assert m["pdserve_kv_transfers_total"] == len(prompts)
    assert m["pdserve_kv_transfer_bytes_total"] > 0
    fallbacks = {k: v for k, v in m.items() if k.startswith("pdserve_local_prefill_fallbacks")}
    assert fallbacks and not any(fallbacks.values()), fallbacks
    assert not any(v for k, v in m.items() if k.startswith("pdserve_kv_transfer_failures_total"))


@pytest.mark.timeout(420)
def test_a_pair_that_cannot_connect_costs_one_bounded_wait_and_every_fallback_shows(
    nodes, tmp_path
):
    prompts = random_prompts([25, 18, 30, 22], seed=92)
    # The prompts go twice: at once, and again 6 s later, while the pair's first background
    # attempt (after a 5 s backoff) is itself waiting out its timeout.
    seen = serve_and_probe(
        nodes,
        tmp_path,
        ["--prefill", "1", "--decode", "1", "--prefill-resources", '{"node_a": 1}',
         "--decode-resources", '{"node_b": 1}', "--kv-interface", "lo"],
        prompts,
        probe_flags=("--again-after", "6"),
    )  # fmt: skip
    assert all(w["kv_host"] == "127.0.0.1" for w in seen["workers"]), seen["workers"]
    assert len(seen["again"]) == len(prompts)
    for prompt, r in zip(prompts * 2, seen["results"] + seen["again"]):
        assert r["tokens"] == hf_greedy(MODEL, prompt, MAX_NEW)
        assert r["path"] == "PATH_DISAGGREGATED" and r["kv_fallback"] == "pairing_failed", r
        # The pairing timed out at the start, before the server took requests; no request
        # waits it out again, during a retry neither.
        assert r["wall_s"] < PAIR_TIMEOUT_S, r
    m = seen["metrics"]
    assert m["pdserve_local_prefill_fallbacks_total{reason=pairing_failed}"] == 2 * len(prompts)
    assert m["pdserve_kv_transfers_total"] == 0
    assert "pairing prefill-0 -> decode-0 failed" in seen["log"], seen["log"][-3000:]


@pytest.mark.timeout(420)
def test_without_placement_flags_workers_spread_over_the_nodes(nodes, tmp_path):
    prompts = random_prompts([17, 29], seed=93)
    # As on a head node: `--ray-address auto` finds the runtime `ray start` runs there.
    seen = serve_and_probe(
        nodes, tmp_path, ["--prefill", "0", "--decode", "2"], prompts, address="auto"
    )
    ips = sorted(w["node_ip"] for w in seen["workers"])
    assert ips == [netns.HEAD_IP, netns.NODE_IP], seen["workers"]
    for prompt, r in zip(prompts, seen["results"]):
        assert r["tokens"] == hf_greedy(MODEL, prompt, MAX_NEW)
