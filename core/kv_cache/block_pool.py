"""The fixed pool of KV-cache blocks: allocation, reference counts, the prefix-cache map.

    block id:   0      1   2   3   ...   num_blocks-1
                null   |<------- usable blocks ------->|

Block 0 is the *null block*: it is never handed out, so the model runner can pad block
tables (and point padding slots) at it without corrupting anyone's K/V. Usable blocks are
1..num_blocks-1.

A block is in exactly one of these states:
    in use        ref_cnt > 0, not in the free queue (hash set once it is full and cached)
    free cached   ref_cnt == 0, in the free queue, hash still registered: a prefix hit
                  can revive it (``touch``) until it is evicted
    free empty    ref_cnt == 0, in the free queue, no hash
Allocation pops from the free queue's head (least recently freed) and evicts the popped
block's hash, so free cached blocks are reused in LRU order.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from halserve.kv_cache.block import BlockId, KVCacheBlock
from halserve.kv_cache.free_queue import FreeBlockQueue
from halserve.kv_cache.hashing import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks={num_blocks} is too small: block 0 is reserved as the null block, "
                "so the KV cache needs at least 2 blocks (raise num_kv_blocks or kv_cache_memory)"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(BlockId(i)) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        # One block per hash: if two requests compute the same block concurrently, the
        # first registered wins and the duplicate simply stays uncached.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Free blocks, cached ones included (they can be evicted on demand)."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (0.0 when idle; cached free blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        """The free or in-use block registered under ``block_hash`` for KV-cache group ``group``."""
        return self.cached_block_hash_to_block.get(block_hash if not group else _group_key(block_hash, group))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock] | None:
        """``num_blocks`` fresh blocks with ref_cnt 1, or None (nothing changed) if too few are free."""
        assert num_blocks >= 0
        if num_blocks > self.get_num_free_blocks():
            return None
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0 and not block.is_null
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def uncache(self, block: KVCacheBlock) -> None:
        """Stop serving ``block`` as a prefix hit (its content is wrong); it stays with its holders."""
        self._evict(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (prefix hits); free ones leave the free queue."""
        for block in blocks:
            assert not block.is_null
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block. Blocks reaching 0 join the free queue's tail in
        the given order, so pass the ones to evict first, first."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0 and not block.is_null, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        group: int = 0,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` (a request's table) under
        ``block_hashes`` (that request's chained hashes) so other requests can hit them.
        ``group``: the KV-cache group the table belongs to (equal tokens hold different layers'
        K/V in each group, so group g > 0 registers under ``(hash, g)``); null entries (blocks a
        sliding window released) are skipped."""
        if not self.enable_caching:
            return
        assert num_full_blocks <= len(blocks) and num_full_blocks <= len(block_hashes)
        cached = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            key = block_hashes[i] if not group else _group_key(block_hashes[i], group)
            if block.block_hash is not None:  # a prefix hit: already registered
                assert block.block_hash == key
                continue
            if block.is_null or key in cached:
                continue  # released by a window, or a duplicate computed concurrently (the first serves hits)
            block.block_hash = key
            cached[key] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only when no block is in use (returns False otherwise),
        since in-use blocks would otherwise be re-registered inconsistently."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True


def _group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of ``block_hash`` in KV-cache group ``group`` > 0 (group 0: the hash itself)."""
    return BlockHash(block_hash + group.to_bytes(2, "little"))
