"""The KV layout two workers must share before one may write into the other's cache.

A prefill worker and a decode worker exchange their `KVLayout` when they first connect. Blocks
travel as raw bytes, so any difference (geometry, dtype, or the model that produced the values)
would silently corrupt the receiver's cache: the pairing is refused instead, with an error that
names every differing field.

Per layer, the cache is [num_blocks, 2, block_size, num_kv_heads, head_dim] (engine/kv_cache.py):
one block of one layer is one contiguous run of `bytes_per_block_layer` bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

import torch

from engine.kv_cache import KVCacheSpec


class LayoutMismatchError(ValueError):
    """Two KV layouts differ. `fields` names the differing fields; the message gives both values."""

    def __init__(self, diffs: list[tuple[str, object, object]]) -> None:
        parts = "; ".join(f"{name}: local={a!r} remote={b!r}" for name, a, b in diffs)
        super().__init__(f"KV layout mismatch ({parts})")
        self.fields = tuple(name for name, _, _ in diffs)


def model_identity(name: str, config_text: str) -> str:
    """A model identity string: the name plus a short stable hash of its config text."""
    digest = hashlib.sha256(config_text.encode()).hexdigest()[:12]
    return f"{name}@{digest}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class KVLayout:
    model: str  # identity of the weights that produced the values (see model_identity)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"dtype: {self.dtype!r} is not a torch dtype name")

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, model_id: str) -> KVLayout:
        return cls(
            model=model_id,
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            block_size=spec.block_size,
            dtype=dtype_name(spec.dtype),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype)
        assert isinstance(dtype, torch.dtype)
        return dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """Shape of one block of one layer: [2 (K, V), block_size, num_kv_heads, head_dim]."""
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block_layer(self) -> int:
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers."""
        return self.num_layers * self.bytes_per_block_layer

    def bytes_for_blocks(self, n: int, num_layers: int | None = None) -> int:
        """Bytes moved by a transfer of `n` blocks over `num_layers` layers (default: all)."""
        layers = self.num_layers if num_layers is None else num_layers
        return n * layers * self.bytes_per_block_layer

    def matches_spec(self, spec: KVCacheSpec) -> bool:
        """Whether a local cache built from `spec` has this geometry and dtype."""
        return KVLayout.from_spec(spec, self.model) == self

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> KVLayout:
        data = json.loads(text)
        names = {f.name for f in fields(cls)}
        if set(data) != names:
            raise ValueError(f"KV layout fields {sorted(data)} != expected {sorted(names)}")
        return cls(**data)


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Raise LayoutMismatchError naming each field where `local` and `remote` differ."""
    diffs = [
        (f.name, getattr(local, f.name), getattr(remote, f.name))
        for f in fields(KVLayout)
        if getattr(local, f.name) != getattr(remote, f.name)
    ]
    if diffs:
        raise LayoutMismatchError(diffs)
