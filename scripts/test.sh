#!/usr/bin/env bash
# Install into .venv with the test tools, then lint, type-check and run the tests.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k sampling`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install.sh test
# The metrics test runs a real Prometheus server (Debian's package).
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing Debian's prometheus for the metrics test"
        { apt-get update -qq \
            && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                prometheus >/dev/null; } \
            || echo "warning: could not install prometheus; tests/test_prometheus.py will fail" >&2
    else
        echo "warning: prometheus is not installed; tests/test_prometheus.py will fail" >&2
        echo "         (as root: apt-get install --no-install-recommends prometheus)" >&2
    fi
fi
export PATH="$PWD/.venv/bin:$PATH"
ruff check .
mypy engine kv_transfer prefill_worker decode_worker both_worker router worker_protocol pdserve_client
python -m pytest -q --durations=15 "$@"
