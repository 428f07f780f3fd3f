"""Free blocks in eviction order: an intrusive doubly linked list.

    head <-> b7 <-> b3 <-> b9 <-> tail        popleft() takes b7 (least recently freed)
                                               append(b) puts b after b9

Everything is O(1), including removing a block from the middle: that is what a prefix-
cache hit on a free cached block does (``BlockPool.touch``). A ``deque`` cannot do that.
"""
from __future__ import annotations

from collections.abc import Iterable

from halserve.kv_cache.block import BlockId, KVCacheBlock


class FreeBlockQueue:
    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        # Sentinels keep insert/remove branch-free.
        self._head = KVCacheBlock(BlockId(-1))
        self._tail = KVCacheBlock(BlockId(-1))
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the block to evict next; ValueError when empty."""
        first = self._head.next_free
        assert first is not None
        if first is self._tail:
            raise ValueError("no free blocks to pop: the free block queue is empty")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        assert block.prev_free is None and block.next_free is None, f"block {block.block_id} is already free"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail (eviction order). O(n): for tests and debugging."""
        out = []
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            out.append(node)
            node = node.next_free
        return out
