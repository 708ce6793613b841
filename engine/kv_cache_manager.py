"""Per-request block bookkeeping on top of the block pool: prefix hits, slot growth, release."""

from __future__ import annotations

from typing import NamedTuple

from engine import prefix_hash
from engine.block_pool import BlockPool
from engine.request import Request


class ComputedBlocks(NamedTuple):
    block_ids: list[int]
    num_tokens: int


_NOTHING_COMPUTED = ComputedBlocks([], 0)  # never mutated


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)

    def _hashes(self, req: Request) -> list[bytes]:
        return prefix_hash.extend_block_hashes(req.block_hashes, req.token_ids, self.block_size)

    def get_computed_blocks(self, req: Request) -> ComputedBlocks:
        """Longest cached prefix of a request that holds no blocks yet (capped at len - 1); one
        whose prompt logprobs are due takes no more than the positions it has them for (none
        at first: each is computed for them; after a preemption, those it had)."""
        if not self.pool.enable_caching:
            return ComputedBlocks([], 0)
        limit = prefix_hash.max_cacheable_tokens(req.num_tokens, self.block_size) // self.block_size
        if req.prompt_logprobs_due:
            limit = min(limit, len(req.prompt_logprobs) // self.block_size)
        blocks = self.pool.lookup(self._hashes(req)[:limit])
        return ComputedBlocks(blocks, len(blocks) * self.block_size)

    def blocks_needed(self, req: Request, num_new_tokens: int, computed: ComputedBlocks) -> int:
        total = req.num_computed_tokens + computed.num_tokens + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(req.block_ids) - len(computed.block_ids))

    def free_slots(self, req: Request, computed: ComputedBlocks | None = None) -> int:
        """Tokens `req` could take now: the rest of its last block plus the free blocks."""
        computed = computed or _NOTHING_COMPUTED
        reused_free = sum(1 for b in computed.block_ids if self.pool.ref_cnt[b] == 0)
        held = (len(req.block_ids) + len(computed.block_ids)) * self.block_size
        slack = held - req.num_computed_tokens - computed.num_tokens
        return slack + (self.pool.num_free_blocks - reused_free) * self.block_size

    def can_allocate(self, req: Request, num_new_tokens: int, computed: ComputedBlocks) -> bool:
        # Touching a cached block that sits in the free queue takes it out of the free pool.
        reused_free = sum(1 for b in computed.block_ids if self.pool.ref_cnt[b] == 0)
        need = self.blocks_needed(req, num_new_tokens, computed)
        return need + reused_free <= self.pool.num_free_blocks

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> bool:
        """Grow `req` to hold `num_new_tokens` more tokens; False (and no change) if blocks lack."""
        if computed is None:
            if req.num_computed_tokens + num_new_tokens <= len(req.block_ids) * self.block_size:
                return True  # its last block has room (most decode steps): nothing to allocate
            computed = _NOTHING_COMPUTED
        if not self.can_allocate(req, num_new_tokens, computed):
            return False
        # Counted once, when the request is first admitted (not on every failed attempt, nor
        # again after a preemption, where the hit is its own output's blocks).
        first = req.num_computed_tokens == 0 and not req.block_ids and not req.num_preemptions
        if first and self.pool.enable_caching:
            self.pool.stats.queries += req.num_tokens
            self.pool.stats.hits += computed.num_tokens
        if computed.block_ids:
            self.pool.touch(computed.block_ids)
            req.block_ids.extend(computed.block_ids)
            req.num_computed_tokens += computed.num_tokens
            if first:
                req.num_cached_tokens = computed.num_tokens
        need = self.blocks_needed(req, num_new_tokens, _NOTHING_COMPUTED)
        if need:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the full blocks whose KV is now computed."""
        n_full = req.num_computed_tokens // self.block_size
        if n_full <= req.num_registered_blocks or not self.pool.enable_caching:
            return  # no block filled up since the last call (most decode steps)
        hashes = self._hashes(req)
        for i in range(req.num_registered_blocks, n_full):
            self.pool.cache_block(req.block_ids[i], hashes[i])
        req.num_registered_blocks = max(req.num_registered_blocks, n_full)

    def free(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_registered_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage
