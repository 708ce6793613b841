"""The dtype a checkpoint itself declares: what `--dtype auto` runs in on CUDA.

- A Hugging Face folder: `dtype` (transformers 5) or `torch_dtype` (older) in its config.json.
  Absent, or a dtype pdserve does not run: float32, what transformers loads without one.
- A GGUF file: its `general.file_type`. F32, F16 and BF16 files map to their own dtype. A
  quantized file (Q4_1, Q8_0, K-quants, ...) has no float dtype of its own: bfloat16, the dtype
  most such models were trained and published in, and one with float32's exponent range, so
  dequantized weights and activations cannot overflow as they can in float16. A file without
  the key: float32.

Only the header is read (never the tensors), so this costs milliseconds even for large files.
`gguf_architecture` reads `general.architecture` from the same header, so a GGUF file of a
model pdserve does not run is refused before it is dequantized.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import BinaryIO

from engine.config import DTYPES

# Built-in tiny models have no checkpoint. They stand in for real ones, most of which declare
# bfloat16, so `auto` on CUDA runs them as it would run a real model.
TINY_MODEL_DTYPE = "bfloat16"
FALLBACK_DTYPE = "float32"

# GGUF general.file_type values (llama.cpp's LLAMA_FTYPE) with a float dtype of their own;
# every other value is a quantized file.
_GGUF_FLOAT_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}
QUANTIZED_GGUF_DTYPE = "bfloat16"

_GGUF_MAGIC = b"GGUF"
# GGUF metadata value types: fixed sizes; 8 is a string, 9 an array.
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def folder_dtype(folder: Path) -> str:
    """The dtype a Hugging Face folder's config.json declares (see the module docstring)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return FALLBACK_DTYPE
    declared = config.get("dtype") or config.get("torch_dtype")
    if isinstance(declared, str):
        declared = declared.removeprefix("torch.")
    return declared if declared in DTYPES else FALLBACK_DTYPE


def gguf_dtype(path: Path) -> str:
    """The dtype a GGUF file's `general.file_type` stands for (see the module docstring)."""
    file_type = gguf_file_type(path)
    if file_type is None:
        return FALLBACK_DTYPE
    return _GGUF_FLOAT_FILE_TYPES.get(file_type, QUANTIZED_GGUF_DTYPE)


def gguf_file_type(path: Path) -> int | None:
    """`general.file_type` from a GGUF file's metadata; None when absent or unreadable."""
    value = _gguf_header_value(path, "general.file_type")
    return value if isinstance(value, int) else None


def gguf_architecture(path: Path) -> str | None:
    """`general.architecture` (`llama`, `qwen2`, ...) from a GGUF file's metadata; None when
    absent or unreadable."""
    value = _gguf_header_value(path, "general.architecture")
    return value if isinstance(value, str) else None


def is_gguf(path: Path) -> bool:
    """Whether `path` starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == _GGUF_MAGIC
    except OSError:
        return False


def _gguf_header_value(path: Path, key: str) -> int | str | None:
    """The metadata value under `key` when it is a 32-bit integer or a string; None when absent,
    of another type, or the header is unreadable."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != _GGUF_MAGIC:
                return None
            _version, _tensors, kv_count = struct.unpack("<IQQ", f.read(20))
            for _ in range(kv_count):
                name = _read_string(f)
                (kind,) = struct.unpack("<I", f.read(4))
                if name == key and kind in (4, 5):  # uint32 / int32
                    return int(struct.unpack("<I" if kind == 4 else "<i", f.read(4))[0])
                if name == key and kind == _GGUF_STRING:
                    return _read_string(f)
                _skip_value(f, kind)
    except (OSError, struct.error, ValueError, UnicodeDecodeError):
        return None
    return None


def _read_string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8")


def _skip_value(f: BinaryIO, kind: int) -> None:
    if kind in _GGUF_SCALAR_SIZES:
        f.seek(_GGUF_SCALAR_SIZES[kind], 1)
    elif kind == _GGUF_STRING:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(n, 1)
    elif kind == _GGUF_ARRAY:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _GGUF_SCALAR_SIZES:
            f.seek(_GGUF_SCALAR_SIZES[item] * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, item)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")
