#!/usr/bin/env bash
# On a machine with CUDA: the tests marked gpu/multigpu and the GPU figures, as one run.
# Installs a CUDA build of torch into .venv (TORCH_INDEX_URL / TORCH_SPEC as in install.sh),
# then writes everything under ${OUT:-gpu-out}/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0} TORCH_INDEX_URL=${TORCH_INDEX_URL:-} \
    bash scripts/install.sh test
export PATH="$PWD/.venv/bin:$PATH"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
python -c "import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.device_count())" \
    | tee "$out/torch.txt"
python -m pytest -q -m "gpu or multigpu" -rs 2>&1 | tee "$out/pytest-gpu.txt"
python -m kv_transfer.bench --json "$out/bench-kv-transfer.json" 2>&1 | tee "$out/kv-bench.txt" || true
pdserve bench-engine --model smollm2-135m --requests 64 --skip hf_continuous \
    --hf-sequential-requests 8 --json "$out/bench-engine-cuda.json" 2>&1 \
    | tail -8 | tee "$out/bench-engine.txt" || true
