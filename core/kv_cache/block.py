"""One physical KV-cache block (the scheduler's view: ids and bookkeeping, no tensors)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

from halserve.kv_cache.hashing import BlockHash

BlockId = NewType("BlockId", int)


@dataclass(slots=True, eq=False)  # identity equality: two blocks are never "equal"
class KVCacheBlock:
    block_id: BlockId
    ref_cnt: int = 0
    """Requests whose block table holds this block; 0 = free (in the free queue)."""
    block_hash: BlockHash | None = None
    """Set once the block is full and registered for prefix caching; kept after it is
    freed (so a later request can hit it) until the block is evicted for reuse."""
    is_null: bool = False
    """Block 0: never allocated, never freed; pads block tables."""
    # Free-queue links (None when not in the queue). repr=False: printing a block must not
    # walk the whole list.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)
