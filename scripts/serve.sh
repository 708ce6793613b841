#!/usr/bin/env bash
# Install into .venv, then answer a prompt with the default model through the offline engine.
#
#   bash scripts/serve.sh                            # the first-request demo
#   bash scripts/serve.sh "Tell me about Lyon."      # your own prompt, as a chat message
#   bash scripts/serve.sh --max-tokens 64 "Hi"       # any `pdserve generate` options
#
# The gRPC router takes this script over once it exists.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install.sh
if (($#)); then
    exec .venv/bin/pdserve generate --chat "$@"
fi
# Greedy, so the demo answers the same way every time.
exec .venv/bin/pdserve generate --chat --temperature 0 "What is the capital of France?"
