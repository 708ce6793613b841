"""Fixed-size KV blocks: reference counts, a prefix cache keyed by chained block hashes, LRU reuse.

Every block is in exactly one of two states:
  - in use: ref_cnt > 0, not in the free queue;
  - free:   ref_cnt == 0, in the free queue. A free block may still hold a cached prefix (its hash
            maps to it in `cached`); it stays reusable by a prefix hit until allocation evicts it.
The free queue is ordered least recently freed first; allocation takes from the front, so cached
blocks that were freed long ago are evicted first. Requests free their blocks tail first, so a
shared prefix outlives the blocks that follow it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found cached


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of `hashes` (not yet referenced)."""
        found: list[int] = []
        if not self.enable_caching:
            return found
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            found.append(b)
        return found

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks found by `lookup`."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                # Evict: the block's content is about to be overwritten.
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            out.append(b)
        # Ascending: blocks with neighbouring ids taken together then form one run, which a KV
        # transfer moves straight from (or into) the cache, without a staging copy. (Requests
        # free tail first, so the queue often holds a run in descending order.)
        out.sort()
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block, tail first."""
        for b in reversed(block_ids):
            rc = self.ref_cnt[b] - 1
            if rc < 0:
                raise RuntimeError(f"block {b} freed more often than allocated")
            self.ref_cnt[b] = rc
            if rc == 0:
                self.free_queue[b] = None

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Name a full, computed block by its hash so later prompts can reuse it."""
        if not self.enable_caching or self.block_hash[block_id] is not None:
            return
        if block_hash in self.cached:
            return  # another block already holds this prefix; this one stays anonymous
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id

    def check_invariants(self) -> None:
        for b in range(self.num_blocks):
            assert self.ref_cnt[b] >= 0
            assert (self.ref_cnt[b] == 0) == (b in self.free_queue), b
        for h, b in self.cached.items():
            assert self.block_hash[b] == h

    def all_free(self) -> bool:
        return len(self.free_queue) == self.num_blocks and not any(self.ref_cnt)
