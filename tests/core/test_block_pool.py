"""Block pool, free queue and block hashing."""
import subprocess
import sys

import pytest

from halserve.kv_cache import (
    NONE_HASH,
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
    hash_request_tokens,
)


def ids(blocks):
    return [b.block_id for b in blocks]


# -- free queue -----------------------------------------------------------------------
def test_free_queue_fifo_and_remove_from_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5
    q.remove(blocks[2])
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4, 0]
    assert ids(q.popleft_n(4)) == [1, 3, 4, 0]
    assert len(q) == 0
    with pytest.raises(ValueError, match="empty"):
        q.popleft()
    with pytest.raises(ValueError, match="asked for 1"):
        q.popleft_n(1)


def test_block_repr_does_not_walk_the_queue():
    blocks = [KVCacheBlock(i) for i in range(3000)]
    FreeBlockQueue(blocks)
    assert "prev_free" not in repr(blocks[1500])


# -- pool -----------------------------------------------------------------------------
def test_null_block_is_reserved():
    pool = BlockPool(4)
    assert pool.num_usable_blocks == 3
    assert pool.get_num_free_blocks() == 3
    got = pool.get_new_blocks(3)
    assert sorted(ids(got)) == [1, 2, 3]
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_new_blocks(1) is None
    with pytest.raises(ValueError, match="num_blocks=1"):
        BlockPool(1)


def test_get_new_blocks_failure_changes_nothing():
    pool = BlockPool(5)
    pool.get_new_blocks(2)
    before = ids(pool.free_block_queue.get_all_free_blocks())
    assert pool.get_new_blocks(3) is None
    assert ids(pool.free_block_queue.get_all_free_blocks()) == before
    assert pool.get_num_free_blocks() == 2


def test_ref_counts_and_usage():
    pool = BlockPool(5)
    assert pool.usage == 0.0
    a = pool.get_new_blocks(2)
    assert [b.ref_cnt for b in a] == [1, 1]
    assert pool.usage == pytest.approx(0.5)
    pool.touch(a)  # a second request shares them
    assert [b.ref_cnt for b in a] == [2, 2]
    pool.free_blocks(a)
    assert pool.get_num_free_blocks() == 2  # still held by the other request
    pool.free_blocks(a)
    assert pool.get_num_free_blocks() == 4 and pool.usage == 0.0


def test_lru_eviction_order_and_hash_eviction():
    pool = BlockPool(5)  # usable 1..4
    blocks = pool.get_new_blocks(4)
    hashes = hash_request_tokens(2, list(range(8)))
    pool.cache_full_blocks(blocks, hashes, 0, 4)
    assert all(pool.get_cached_block(h) is b for h, b in zip(hashes, blocks))
    # Freed tail-first (as the manager does): the tail is evicted first.
    pool.free_blocks(reversed(blocks))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == ids(reversed(blocks))
    # Free cached blocks still serve hits...
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    # ...until evicted: allocating one takes the LRU head (the request's last block).
    (evicted,) = pool.get_new_blocks(1)
    assert evicted is blocks[3]
    assert evicted.block_hash is None and pool.get_cached_block(hashes[3]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]


def test_touch_revives_free_cached_block():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    (h,) = hash_request_tokens(2, [5, 6])
    pool.cache_full_blocks([b], [h], 0, 1)
    pool.free_blocks([b])
    assert pool.get_num_free_blocks() == 3
    pool.touch([pool.get_cached_block(h)])
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    assert b not in pool.free_block_queue.get_all_free_blocks()
    # It is not handed out again while in use.
    assert b not in pool.get_new_blocks(2)


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    (h,) = hash_request_tokens(2, [1, 2])
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.cache_full_blocks([b], [h], 0, 1)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    # Evicting the uncached duplicate does not drop the first copy.
    pool.free_blocks([b])
    pool.get_new_blocks(2)
    assert pool.get_cached_block(h) is a


def test_caching_disabled_registers_nothing():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, hash_request_tokens(2, [1, 2, 3, 4]), 0, 2)
    assert pool.cached_block_hash_to_block == {} and blocks[0].block_hash is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, hash_request_tokens(2, [1, 2]), 0, 1)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {} and blocks[0].block_hash is None


# -- hashing --------------------------------------------------------------------------
def test_hashes_are_chained():
    h = hash_request_tokens(4, list(range(10)))
    assert len(h) == 2  # the partial tail block (2 tokens) is not hashed
    assert h[0] == hash_block_tokens(None, [0, 1, 2, 3]) == hash_block_tokens(NONE_HASH, [0, 1, 2, 3])
    assert h[1] == hash_block_tokens(h[0], [4, 5, 6, 7])
    # Same block content after a different prefix -> different hash.
    other = hash_request_tokens(4, [9, 9, 9, 9, 4, 5, 6, 7])
    assert other[1] != h[1]
    assert len(h[0]) == 32 and isinstance(h[0], bytes)


def test_extra_keys_change_hash_and_are_validated():
    base = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2], ("lora-a",)) != base
    assert hash_block_tokens(None, [1, 2], ("lora-a",)) != hash_block_tokens(None, [1, 2], ("lora-b",))
    assert hash_block_tokens(None, [1, 2], (1,)) != hash_block_tokens(None, [1, 2], ("1",))
    with pytest.raises(ValueError, match="cannot be hashed stably"):
        hash_block_tokens(None, [1, 2], (1.5,))


def test_hashes_stable_across_processes():
    code = (
        "from halserve.kv_cache import hash_request_tokens;"
        "print(','.join(h.hex() for h in hash_request_tokens(4, list(range(12)), ('x', 3))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
    ).stdout.strip()
    here = ",".join(h.hex() for h in hash_request_tokens(4, list(range(12)), ("x", 3)))
    assert out == here
