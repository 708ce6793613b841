import pytest

from engine import prefix_hash
from engine.block_pool import BlockPool


def test_allocate_free_reverse_order_and_lru():
    pool = BlockPool(4)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert pool.num_free_blocks == 0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(a)  # tail first: a[1] then a[0] enter the free queue
    assert list(pool.free_queue) == [a[1], a[0]]
    pool.free(b)
    assert pool.allocate(1) == [a[1]]  # least recently freed first
    pool.free([a[1]])
    pool.check_invariants()
    assert pool.all_free()


def test_cached_block_survives_free_until_evicted():
    pool = BlockPool(3)
    h = prefix_hash.block_hashes([1, 2, 3, 4], 4)
    (b,) = pool.allocate(1)
    pool.cache_block(b, h[0])
    pool.free([b])
    assert pool.lookup(h) == [b]
    pool.touch([b])  # a prefix hit revives it out of the free queue
    assert pool.ref_cnt[b] == 1 and b not in pool.free_queue
    pool.free([b])
    pool.allocate(3)  # evicts everything, including the cached block
    assert pool.lookup(h) == []
    pool.check_invariants()


def test_ref_counts_shared_block():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.touch([b])
    pool.free([b])
    assert pool.ref_cnt[b] == 1 and pool.num_free_blocks == 1
    pool.free([b])
    assert pool.all_free()
    with pytest.raises(RuntimeError):
        pool.free([b])


def test_prefix_hash_is_chained_and_stable():
    a = prefix_hash.block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = prefix_hash.block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2
    assert a[1] != b[1]  # same second block, different past
    assert a == prefix_hash.block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    # A fixed value: the hash must not change between processes or releases.
    assert prefix_hash.block_hashes([1, 2], 2)[0].hex() == (
        "49cf8d63fa15c01d2f7be6c1d0c734effce4df00528927876ab397c653cb0104"
    )
    assert prefix_hash.max_cacheable_tokens(8, 4) == 4
    assert prefix_hash.max_cacheable_tokens(9, 4) == 8


def test_blocks_freed_tail_first_come_back_as_one_ascending_run():
    pool = BlockPool(16)
    a = pool.allocate(5)
    b = pool.allocate(3)
    assert a == [0, 1, 2, 3, 4] and b == [5, 6, 7]
    pool.free(list(reversed(b)))  # requests free tail first
    rest = pool.allocate(8)  # the untouched 8..15
    again = pool.allocate(3)
    assert again == [5, 6, 7]  # one ascending run again: a KV transfer moves it without a copy
    pool.free(a + rest + again)
    assert pool.num_free_blocks == 16
