"""`pdserve serve` on a machine where `ray start` already left a Ray runtime running: without
--ray-address it serves on that runtime and says so in one line (no traceback); its workers are
that runtime's actors. Run in a network namespace of its own (tests/netns.py), so that neither
runtime sees the other or the test session's Ray."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import netns

why_not = netns.available()
pytestmark = pytest.mark.skipif(why_not is not None, reason=f"existing-runtime test: {why_not}")


def gcs_servers(node: netns.LoneNode) -> int:
    """Ray runtimes running in the namespace (one GCS server each)."""
    n = 0
    for pid in netns.pids(node.ns):
        try:
            n += "gcs_server" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            pass  # ended meanwhile
    return n


@pytest.mark.timeout(300)
def test_serve_uses_a_runtime_already_running_and_says_so(tmp_path):
    with netns.LoneNode() as node:
        log = tmp_path / "serve.log"
        server = node.start(
            [sys.executable, "-m", "router.cli", "serve", "--model", "tiny-llama",
             "--kv-cache-gib", "0.05", "--metrics-port", "-1", "--admin-port", "50052"],
            log,
        )  # fmt: skip
        try:
            done = node.run(
                [sys.executable, "-m", "router.cli", "complete", "--wait", "--timeout", "180",
                 "--max-tokens", "4", "--json", "hello"],
                timeout=200,
            )  # fmt: skip
            assert done.returncode == 0, f"{done.stderr}\n--- server ---\n{log.read_text()}"
            assert '"completion_tokens": 4' in done.stdout
            listed = node.run([sys.executable, "-m", "router.cli", "workers"], timeout=30)
            assert listed.returncode == 0, listed.stderr
            # The workers run in the runtime `ray start` left: no second Ray was started.
            assert gcs_servers(node) == 1
        finally:
            netns.stop(server)
        text = log.read_text()
        assert text.count("a Ray runtime is already running on this machine") == 1, text
        assert "Traceback" not in text, text
        assert server.returncode == 0, text
