"""The dtypes an engine runs in, by name, and the other spellings the command lines take for
them (as other serving systems' options do). No torch here: the CLI's parser reads these
without loading it."""

from __future__ import annotations

DTYPE_NAMES = ("float32", "bfloat16", "float16")
# "auto": the checkpoint's own dtype on CUDA, float32 on CPU (engine.config.resolve_dtype).
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16",
                 "bf16": "bfloat16"}  # fmt: skip


def canonical_dtype(word: str) -> str:
    """`word` as one of DTYPE_CHOICES (any case; an alias as its name); ValueError otherwise."""
    lower = word.lower()
    name = DTYPE_ALIASES.get(lower, lower)
    if name not in DTYPE_CHOICES:
        also = ", ".join(DTYPE_ALIASES)
        raise ValueError(f"must be one of {', '.join(DTYPE_CHOICES)} (also {also}), got {word!r}")
    return name
