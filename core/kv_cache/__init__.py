"""Paged KV-cache bookkeeping: block pool, free queue, chained block hashes, per-request tables."""
from halserve.kv_cache.block import BlockId, KVCacheBlock
from halserve.kv_cache.block_pool import BlockPool
from halserve.kv_cache.free_queue import FreeBlockQueue
from halserve.kv_cache.hashing import NONE_HASH, BlockHash, extend_block_hashes, hash_block_tokens, hash_request_tokens
from halserve.kv_cache.manager import KVCacheManager
from halserve.kv_cache.spec import (
    SPEC_KINDS,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
    group_layers,
    is_recurrent,
    spec_for_window,
)
from halserve.kv_cache.spec_kinds import SpecKind, known_spec_kinds, register_spec_kind

__all__ = [
    "NONE_HASH",
    "SPEC_KINDS",
    "BlockHash",
    "BlockId",
    "BlockPool",
    "FreeBlockQueue",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheGroup",
    "KVCacheManager",
    "KVCacheSpec",
    "MLASpec",
    "MambaSpec",
    "SlidingWindowSpec",
    "SpecKind",
    "extend_block_hashes",
    "group_layers",
    "hash_block_tokens",
    "hash_request_tokens",
    "is_recurrent",
    "known_spec_kinds",
    "register_spec_kind",
    "spec_for_window",
]
