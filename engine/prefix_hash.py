"""Prefix hashing: the one place that names a block of tokens by its content and its past.

A full block's hash is sha256(parent hash || token ids of the block || extra key), so equal hashes
mean equal whole prefixes, not just equal blocks. The hash is stable across processes and runs
(unlike Python's `hash`), so the router, prefill and decode workers agree on it.

Only full blocks are hashed. Hits are capped by the caller at len(tokens) - 1 so the last prompt
token is always computed and produces logits.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = b"pdserve-prefix-v1"


def hash_block(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    if extra:
        h.update(extra)
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes], tokens: Sequence[int], block_size: int, extra: bytes = b""
) -> list[bytes]:
    """Append the hashes of full blocks of `tokens` not yet in `hashes`; return `hashes`."""
    n_full = len(tokens) // block_size
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), n_full):
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


def block_hashes(tokens: Sequence[int], block_size: int, extra: bytes = b"") -> list[bytes]:
    return extend_block_hashes([], tokens, block_size, extra)


def max_cacheable_tokens(num_tokens: int, block_size: int) -> int:
    """The most prompt tokens a prefix hit may cover: whole blocks, and never the last token."""
    return ((num_tokens - 1) // block_size) * block_size
