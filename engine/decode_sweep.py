"""Decode-step time against the memory roofline, on random weights of a model's shape.

    python -m engine.decode_sweep [--shape llama-3.1-8b|smollm2-135m|tiny] [--batches 1,16,64,128]
                                  [--context 1024] [--dtype bfloat16] [--device auto] [--chunk N]
                                  [--json FILE]

A decode step must read every weight once and each running request's KV once. For each batch
size B it runs the engine's model runner (paged KV, the chosen attention backend, sampling) on
steps of B decodes whose context is `--context` tokens, and reports the median step time and the
fraction of the roofline it reaches:

    roofline fraction = (weight bytes + KV bytes read) / step time / measured copy bandwidth

where the copy bandwidth is the device's own, measured here (a large buffer copied on the
device: bytes read plus bytes written, per second). The weights are random (a decode step's
time does not depend on their values), built on the device from a config written here: no
download. The KV cache's contents are arbitrary for the same reason.

With --chunk N it also times each batch's step with a prompt's N-token chunk beside the decodes,
as chunked prefill runs one, and reports how much slower that step is than the decodes alone:
what every request decoding on a worker pays for each step that prefills there. On a 2-core CPU
host (one thread, the SmolLM2-135M shape, float32, context 256) a 16-token chunk, the smallest
the scheduler cuts, made the step 2.50x slower at batch 1 and 1.36x at batch 16
(benchmarks/decode-sweep-cpu-smollm2-chunk16.json).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, resolve_device
from engine.model_runner import ModelRunner
from engine.outputs import ScheduledRequest, SchedulerOutput
from engine.provenance import provenance, write_json
from engine.sampling_params import SamplingParams

# Llama-family shapes: hidden, layers, heads, kv heads, intermediate, vocab, head_dim.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=512, rope_theta=10000.0, tie_word_embeddings=False,
    ),
}  # fmt: skip


def random_model(shape: str, device: torch.device, dtype: torch.dtype) -> Any:
    """A LlamaForCausalLM of `shape` with random weights, built on `device` in `dtype`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=131072, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(cfg)
    return torch.nn.Module.to(model, dtype).eval()


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_step(batch: int, context: int, block_size: int, chunk: int = 0) -> SchedulerOutput:
    """B decodes, each at position `context - 1` of its own blocks (block tables disjoint); with
    `chunk`, beside them a prompt's chunk of that many tokens at positions `context`.. of blocks
    of its own (a prompt's middle, as chunked prefill runs it: its first `context` tokens
    cached, no token sampled)."""
    per = -(-context // block_size)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    decodes = tuple(
        ScheduledRequest(
            request_id=f"r{i}",
            token_ids=(1,),
            start_pos=context - 1,
            block_ids=tuple(range(i * per, (i + 1) * per)),
            sample=True,
            sampling=greedy,
        )
        for i in range(batch)
    )
    prompt: tuple[ScheduledRequest, ...] = ()
    if chunk:
        first = batch * per
        prompt = (
            ScheduledRequest(
                request_id="prompt",
                token_ids=(1,) * chunk,
                start_pos=context,
                block_ids=tuple(range(first, first + -(-(context + chunk) // block_size))),
                sample=False,
                sampling=greedy,
            ),
        )
    return SchedulerOutput(scheduled=decodes + prompt, num_batched_tokens=batch + chunk)


def _median_step_s(runner: ModelRunner, so: SchedulerOutput, args: argparse.Namespace) -> float:
    for _ in range(args.warmup):
        runner.execute(so)
    times = []
    for _ in range(args.steps):
        _sync(runner.device)
        t0 = time.perf_counter()
        runner.execute(so)
        _sync(runner.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    hf = random_model(args.shape, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    if hf.config.tie_word_embeddings:  # one matrix, read by the embedding and the LM head
        weight_bytes -= hf.lm_head.weight.numel() * hf.lm_head.weight.element_size()
    block_size = 16
    chunk = args.chunk
    blocks = max(args.batches) * -(-args.context // block_size) + 8
    blocks += -(-(args.context + chunk) // block_size) if chunk else 0
    config = EngineConfig(
        model=ModelConfig(
            model=args.shape, device=str(device), dtype=args.dtype,
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
        ),
        cache=CacheConfig(block_size=block_size, num_blocks=blocks),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max(512, max(args.batches) + chunk),
            # As without a chunk (the decode graphs captured are the same): the runner's step
            # buffers grow for the chunk's row on its first step, in the warm-up.
            max_num_seqs=max(args.batches),
        ),
    )  # fmt: skip
    runner = ModelRunner(hf, config)
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    kv_per_token = 2 * runner.spec.num_layers * runner.spec.num_kv_heads * runner.spec.head_dim
    kv_per_token *= torch.tensor([], dtype=dtype).element_size()
    bandwidth = copy_bandwidth(device, nbytes=args.copy_bytes)
    rows = []
    for b in args.batches:
        step_s = _median_step_s(runner, decode_step(b, args.context, block_size), args)
        nbytes = weight_bytes + b * args.context * kv_per_token
        row = {
            "batch": b,
            "step_ms": step_s * 1000,
            "bytes_read": nbytes,
            "roofline_fraction": nbytes / step_s / bandwidth,
            "tokens_per_s": b / step_s,
        }
        if chunk:
            # What the prompt's chunk adds to the decodes' step: the interference a request
            # decoding there sees in each step that prefills beside it.
            with_chunk_s = _median_step_s(
                runner, decode_step(b, args.context, block_size, chunk), args
            )
            row["with_chunk_ms"] = with_chunk_s * 1000
            row["chunk_slowdown"] = with_chunk_s / step_s
        rows.append(row)
    return {
        "shape": args.shape,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "attention_backend": runner.attention.name,
        "decode_graphs": runner.graphs is not None,
        "context": args.context,
        "chunk": chunk,
        "threads": torch.get_num_threads(),
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "rows": rows,
    }


def _chunk(text: str) -> int:
    n = int(text)
    if n < 0 or n == 1:  # one token beside decodes is a decode's shape, not a prompt's chunk
        raise argparse.ArgumentTypeError(f"{text}: 0 (none) or at least 2 tokens")
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.decode_sweep", description=__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--batches", default="1,16,64,128")
    p.add_argument("--context", type=int, default=1024, help="tokens each request holds")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "sdpa", "paged"])
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--chunk",
        type=_chunk,
        default=0,
        help="also time each batch's step with a prompt's chunk of this many tokens beside the "
        "decodes (at the same context): what prefilling beside decodes costs them",
    )
    p.add_argument("--copy-bytes", type=int, default=1 << 30)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    made = provenance()  # at the start: when it started, from which checkout
    args.batches = [int(b) for b in args.batches.split(",")]
    res = sweep(args)
    print(
        f"{res['shape']} on {res['device']}, {res['dtype']}, {res['attention_backend']} "
        f"attention, {'graphs' if res['decode_graphs'] else 'eager'}, context {res['context']}; "
        f"weights {res['weight_bytes'] / 1e9:.2f} GB, "
        f"copy bandwidth {res['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s"
    )
    head = f"{'batch':>6} {'ms/step':>9} {'GB read':>8} {'roofline':>9} {'tok/s':>9}"
    if args.chunk:
        head += f" {f'+{args.chunk}-tok chunk ms':>20} {'slower':>7}"
    print(head)
    for r in res["rows"]:
        line = (
            f"{r['batch']:>6} {r['step_ms']:>9.2f} {r['bytes_read'] / 1e9:>8.2f} "
            f"{r['roofline_fraction']:>9.2f} {r['tokens_per_s']:>9.0f}"
        )
        if args.chunk:
            line += f" {r['with_chunk_ms']:>20.2f} {r['chunk_slowdown']:>6.2f}x"
        print(line)
    if args.json:
        write_json(args.json, res, made)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
