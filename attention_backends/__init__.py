"""Paged-attention backends."""
from halserve.attention_backends.base import KV_CACHE_DTYPES, AttentionBackend, AttentionMetadata

__all__ = ["KV_CACHE_DTYPES", "AttentionBackend", "AttentionMetadata"]
