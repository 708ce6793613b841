"""The CPU paged-decode backend: a small C kernel (engine/csrc/paged_decode.c) that reads K/V
through the block table, so decode steps don't copy every sequence's cache each layer.

The kernel is compiled once per machine with the system C compiler and loaded with ctypes. If no
compiler is there (or it fails), `load_kernel` returns None and the engine keeps the SDPA backend.
Prefill chunks use SDPA either way: they are compute-bound and the gather is small next to them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engine.attention import AttentionMetadata, SdpaAttention
from engine.kv_cache import KVCache

_SRC = Path(__file__).parent / "csrc" / "paged_decode.c"
# -ffast-math's parts, not the flag itself: with it the linker adds crtfastmath.o, whose
# constructor turns on flush-to-zero for the thread that loads the library (every float op of
# the process's main thread, torch's included, would then lose its subnormals).
_FAST_MATH = [
    "-fno-math-errno", "-ffinite-math-only", "-fno-signed-zeros", "-fno-trapping-math",
    "-fassociative-math", "-freciprocal-math",
]  # fmt: skip
_FLAGS = ["-O3", "-march=native", *_FAST_MATH, "-fopenmp-simd", "-shared", "-fPIC", "-std=c11"]
_LIB: ctypes.CDLL | None = None
_TRIED = False


def _cache_dir() -> Path:
    return Path(os.path.expanduser("~/.cache/pdserve/kernels"))


def _build(src: Path, out: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        subprocess.run(
            [cc, *_FLAGS, str(src), "-o", str(tmp_out), "-lm", "-lmvec"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(tmp_out, out)  # atomic: a concurrent builder never sees half a library


def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; None when it can't be built here."""
    global _LIB, _TRIED
    if _TRIED:
        return _LIB
    _TRIED = True
    src = _SRC.read_bytes()
    key = hashlib.sha256(
        src
        + " ".join(_FLAGS).encode()
        + platform.processor().encode()
        + platform.machine().encode()
        + _cpu_model().encode()
    ).hexdigest()[:16]
    lib_path = _cache_dir() / f"paged_decode_{key}.so"
    try:
        if not lib_path.exists():
            _build(_SRC, lib_path)
        lib = ctypes.CDLL(str(lib_path))
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return None
    fn = lib.paged_decode_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    _LIB = lib
    return lib


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool(threads: int) -> ThreadPoolExecutor:
    """One shared pool per thread count for the process: engines come and go, threads don't."""
    if threads not in _POOLS:
        _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="paged-decode")
    return _POOLS[threads]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return ""


class PagedCpuAttention(SdpaAttention):
    """Decodes through the C kernel; prefill chunks through SDPA (inherited)."""

    name = "paged-cpu"

    def __init__(self, cache: KVCache, num_heads: int, scale: float, lib: ctypes.CDLL) -> None:
        super().__init__(cache, num_heads, scale)
        self.fn = lib.paged_decode_f32
        self.spec = cache.spec
        self.threads = max(1, torch.get_num_threads())
        self.pool = _pool(self.threads)
        # The batch split depends only on the step's context lengths: made once per step, not
        # once per layer.
        self._split_for: AttentionMetadata | None = None
        self._parts: list[tuple[int, int]] = []

    def decode(self, layer: int, q: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        q = q.contiguous()
        out = torch.empty_like(q)
        table = md.decode_block_table
        assert table.stride(1) == 1 and table.dtype == torch.long
        cache = self.cache.layers[layer].data_ptr()
        ctx = md.decode_context_lens
        n = q.shape[0]
        if self._split_for is not md:
            self._parts = self._split(ctx, n)
            self._split_for = md
        parts = self._parts

        def run(lo: int, hi: int) -> None:
            # ctypes drops the GIL for the call, so the parts run in parallel.
            self.fn(
                q[lo].data_ptr(),
                cache,
                table[lo].data_ptr(),
                ctx[lo].data_ptr(),
                out[lo].data_ptr(),
                hi - lo,
                self.num_heads,
                self.spec.num_kv_heads,
                self.spec.head_dim,
                self.spec.block_size,
                table.stride(0),  # the row stride: a table may be a view of a wider one
                self.scale,
                1,
            )

        # The calling thread runs the first part itself: one thread handoff fewer per layer.
        futures = [self.pool.submit(run, lo, hi) for lo, hi in parts[1:]]
        run(*parts[0])
        for f in futures:
            f.result()
        return out

    def _split(self, ctx: torch.Tensor, n: int) -> list[tuple[int, int]]:
        """Cut the batch into contiguous parts of about equal context, one per thread."""
        k = min(self.threads, n)
        if k <= 1:
            return [(0, n)]
        cum = ctx.cumsum(0)
        total = int(cum[-1])
        cuts = [0] + [int(torch.searchsorted(cum, total * i // k)) + 1 for i in range(1, k)] + [n]
        cuts = sorted(set(min(max(c, 0), n) for c in cuts))
        return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def supported(cache: KVCache) -> bool:
    return cache.layers[0].device.type == "cpu" and cache.spec.dtype == torch.float32
