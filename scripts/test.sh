#!/usr/bin/env bash
# Install into .venv with the test tools, then lint, type-check and run the tests.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k sampling`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install.sh test
export PATH="$PWD/.venv/bin:$PATH"
ruff check .
mypy engine kv_transfer prefill_worker decode_worker router
python -m pytest -q "$@"
