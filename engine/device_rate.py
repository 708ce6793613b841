"""A quick measurement of what one worker's device does per second, for the router's roofline
seed of the step-time model: dense matmul FLOP/s in the model's dtype and memory copy bytes/s,
with the worker's own thread count. Takes ~0.1-0.3 s on a CPU."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DeviceRate:
    flops_per_s: float
    bytes_per_s: float


def _best_of(fn: object, reps: int, sync: bool) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        if sync:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_device(device: torch.device, dtype: torch.dtype) -> DeviceRate:
    cuda = device.type == "cuda"
    m, k, n = (4096, 4096, 4096) if cuda else (256, 576, 1536)
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    a @ b  # warm-up: first calls pay for kernel selection
    t = _best_of(lambda: a @ b, 5, cuda)
    flops = 2.0 * m * k * n / t
    src = torch.empty(1 << (26 if cuda else 23), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = _best_of(lambda: dst.copy_(src), 5, cuda)
    return DeviceRate(flops_per_s=flops, bytes_per_s=2.0 * src.numel() * src.element_size() / t)
