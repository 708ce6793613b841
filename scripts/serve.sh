#!/usr/bin/env bash
# Install into .venv, then answer a prompt with the default model through the offline engine.
#
#   bash scripts/serve.sh                            # the first-request demo
#   bash scripts/serve.sh "Tell me about Lyon."      # your own prompt (chat template on, greedy)
#   bash scripts/serve.sh --max-tokens 64 "Hi"       # any `pdserve generate` options
#
# The gRPC router takes this script over once it exists.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install.sh
if (($#)); then
    exec .venv/bin/pdserve generate "$@"
fi
exec .venv/bin/pdserve generate "What is the capital of France?"
