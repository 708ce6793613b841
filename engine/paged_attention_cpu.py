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
# -fopenmp links libgomp.so.1: in a process that has imported torch it resolves to the copy torch
# loaded (same soname), so the kernel's threads are torch's own thread pool. Worker threads of
# our own (a Python pool) lost a core to torch's workers, which spin for a while after every
# parallel op: on two cores a threaded decode ran slower than a single-threaded one.
_FLAGS = ["-O3", "-march=native", *_FAST_MATH, "-fopenmp", "-shared", "-fPIC", "-std=c11"]
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

    def decode(self, layer: int, q: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        q = q.contiguous()
        out = torch.empty_like(q)
        table = md.decode_block_table
        assert table.stride(1) == 1 and table.dtype == torch.long
        ctx = md.decode_context_lens
        assert ctx.is_contiguous() and ctx.dtype == torch.int32
        self.fn(
            q.data_ptr(),
            self.cache.layers[layer].data_ptr(),
            table.data_ptr(),
            ctx.data_ptr(),
            out.data_ptr(),
            q.shape[0],
            self.num_heads,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            self.spec.block_size,
            table.stride(0),  # the row stride: a table may be a view of a wider one
            self.scale,
            torch.get_num_threads(),  # the kernel runs on torch's own OpenMP threads
        )
        return out


def supported(cache: KVCache) -> bool:
    return cache.layers[0].device.type == "cpu" and cache.spec.dtype == torch.float32
