#!/usr/bin/env bash
# Install into .venv, then serve the default model over gRPC on 127.0.0.1:50051
# (one prefill and one decode worker on a local Ray runtime). Stop it with Ctrl-C: it drains
# in-flight requests first.
#
#   bash scripts/serve.sh                              # serve the default model
#   bash scripts/serve.sh --decode 2 --policy threshold  # any `pdserve serve` options
#
# Then, from another terminal:
#   .venv/bin/pdserve complete --chat "What is the capital of France?"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install.sh
exec .venv/bin/pdserve serve "$@"
