#!/usr/bin/env bash
# On a machine with CUDA, as one run within 10 minutes, everything landing in ${OUT:-gpu-out}/:
#   1. the tests marked gpu/multigpu (the Triton paged attention in fp32 and bf16 included) and
#      the engine tests with CUDA as the default device;
#   2. bench-engine in bfloat16 on the SmolLM2-135M shape, with decode graphs and without;
#   3. the decode-step sweep on random weights of a Llama-3.1-8B-shaped model (its config written
#      by engine/decode_sweep.py, no download) at batch 1/16/64/128: ms per step and the fraction
#      of the HBM roofline (weight + KV bytes read / step time / the measured copy bandwidth),
#      and each batch's step with a 256-token prompt chunk beside it (how much slower the decodes
#      run while a worker prefills beside them; on a 2-core CPU host a 16-token chunk made the
#      step 1.4-2.5x slower);
#   4. pdserve bench on the GPU: mixed, 120 requests at 8 req/s, colocated, disaggregated and flex,
#      two workers sharing the GPU (--gpus-per-worker 0.5); the step fails if any handoff's KV
#      fell back. Two processes take turns on one GPU, so a request's gap p99 runs several times a
#      lone one's: the ITL SLO is 8x a lone request's (--slo-itl-scale 8).
#
# Two ways to get the dependencies:
#   - online: scripts/install.sh into .venv with a CUDA build of torch (TORCH_SPEC, TORCH_INDEX_URL);
#   - offline (GPU_WHEELS=DIR): the machine's own python3 with its torch, plus the wheels in DIR
#     installed into /tmp/site (and DIR/ray-slim.tar.xz, Ray unpacked, if Ray is missing).
# GPU_MODEL=DIR: a model folder's config and tokenizer (no weights); the throughput figures then
# use random weights of that shape (tokens/s does not depend on the weights' values).
# GPU_SWEEP=0 leaves out step 3, GPU_BENCH=0 step 4. On one H200 steps 1 and 2 took 260 s, and the
# step 4 bench, run by hand, 200 s.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
t_start=$(date +%s)
stamp() { echo "== $(( $(date +%s) - t_start )) s: $*" | tee -a "$out/steps.txt"; }
failed=0
check() {  # the exit status of a step's first command (before its tee)
    if [ "$1" != 0 ]; then failed=1; echo "   failed: exit $1" | tee -a "$out/steps.txt"; fi
}

if [ -n "${GPU_WHEELS:-}" ]; then
    PY=python3
    stamp "offline install from $GPU_WHEELS"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$GPU_WHEELS"/*.whl || exit 1
    if [ -f "$GPU_WHEELS/ray-slim.tar.xz" ] && ! $PY -c "import ray" 2>/dev/null; then
        tar -xJf "$GPU_WHEELS/ray-slim.tar.xz" -C /tmp/site || exit 1
    fi
    export PYTHONPATH="/tmp/site:$PWD"
else
    TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0} TORCH_INDEX_URL=${TORCH_INDEX_URL:-} \
        bash scripts/install.sh test || exit 1
    PY="$PWD/.venv/bin/python"
fi
export PYTHONUNBUFFERED=1

stamp "versions"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
$PY - <<'EOF' 2>&1 | tee "$out/versions.txt"
import grpc, ray, torch, transformers
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
print("transformers", transformers.__version__, "ray", ray.__version__, "grpcio", grpc.__version__)
EOF

stamp "pytest -m 'gpu or multigpu'"
timeout 200 $PY -m pytest -q -p no:cacheprovider -m "gpu or multigpu" -rs \
    tests/test_gpu.py tests/test_kv_transfer_peers.py tests/test_cluster_gpu.py \
    tests/test_triton_attention.py tests/test_dtype.py \
    2>&1 | tee "$out/pytest-gpu.txt"
check "${PIPESTATUS[0]}"

stamp "engine tests, CUDA as the default device"
timeout 120 $PY -X faulthandler -m pytest -q -p no:cacheprovider --maxfail=5 -rs \
    tests/test_engine_equality.py tests/test_engine_api.py tests/test_sampling.py \
    tests/test_async_engine.py tests/test_kv_handoff.py tests/test_cuda_graphs.py 2>&1 \
    | tee "$out/pytest-engine-cuda.txt" | tail -40
check "${PIPESTATUS[0]}"

model=smollm2-135m
if [ -n "${GPU_MODEL:-}" ]; then
    stamp "random weights in the shape of $GPU_MODEL"
    model=/tmp/pdserve-gpu-model
    mkdir -p "$model" && cp "$GPU_MODEL"/* "$model"/
    $PY - "$model" <<'EOF' 2>&1 | tail -3
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(sys.argv[1])
AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(sys.argv[1])
EOF
fi
stamp "bench-engine on CUDA, bfloat16 ($model)"
timeout 120 $PY -m engine.bench_engine --model "$model" --dtype bfloat16 --requests 64 \
    --skip hf_continuous --hf-sequential-requests 8 --json "$out/bench-engine-cuda.json" 2>&1 \
    | tail -12 | tee "$out/bench-engine.txt"
check "${PIPESTATUS[0]}"

stamp "bench-engine on CUDA, bfloat16, --enforce-eager (decode steps without graphs)"
timeout 90 $PY -m engine.bench_engine --model "$model" --dtype bfloat16 --requests 64 \
    --skip hf_continuous,hf_sequential --enforce-eager --json "$out/bench-engine-eager.json" \
    2>&1 | tail -6 | tee "$out/bench-engine-eager.txt"
check "${PIPESTATUS[0]}"

if [ "${GPU_SWEEP:-1}" != 0 ]; then
    stamp "decode-step sweep, Llama-3.1-8B shape, bfloat16"
    timeout 180 $PY -m engine.decode_sweep --shape llama-3.1-8b --batches 1,16,64,128 \
        --context 1024 --dtype bfloat16 --chunk 256 --json "$out/decode-sweep-8b.json" 2>&1 \
        | tail -8 | tee "$out/decode-sweep-8b.txt"
    check "${PIPESTATUS[0]}"
fi
if [ "${GPU_BENCH:-1}" != 0 ]; then
    stamp "pdserve bench on CUDA: mixed, 120 requests at 8/s, two workers sharing the GPU"
    timeout 300 $PY -m router.cli bench --model "$model" --gpus-per-worker 0.5 --trace mixed \
        --num-requests 120 --rate 8 --policy colocated,disaggregated,flex --no-baseline \
        --slo-itl-scale 8 --timeout 60 --json "$out/bench-serve-cuda.json" 2>&1 \
        | grep -v 'req/s]' | tee "$out/bench-serve.txt"
    check "${PIPESTATUS[0]}"
    $PY - "$out/bench-serve-cuda.json" <<'EOF' 2>&1 | tee -a "$out/bench-serve.txt"
import json, sys
fallbacks = {p: f["kv_fallbacks"] for p, f in json.load(open(sys.argv[1]))["policies"].items()}
print("handoffs whose KV fell back, per policy:", fallbacks)
sys.exit(1 if any(fallbacks.values()) else 0)
EOF
    check "${PIPESTATUS[0]}"
fi
stamp "done"
exit "$failed"
