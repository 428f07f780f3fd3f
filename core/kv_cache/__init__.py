"""Paged KV-cache bookkeeping: block pool, free queue, chained block hashes, per-request tables."""
from halserve.kv_cache.block import BlockId, KVCacheBlock
from halserve.kv_cache.block_pool import BlockPool
from halserve.kv_cache.free_queue import FreeBlockQueue
from halserve.kv_cache.hashing import NONE_HASH, BlockHash, extend_block_hashes, hash_block_tokens, hash_request_tokens
from halserve.kv_cache.manager import KVCacheManager

__all__ = [
    "NONE_HASH",
    "BlockHash",
    "BlockId",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "extend_block_hashes",
    "hash_block_tokens",
    "hash_request_tokens",
]
