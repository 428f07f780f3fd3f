"""Chained block hashes for automatic prefix caching.

A full block's hash identifies its content *and everything before it*::

    h0 = H(NONE_HASH, tokens[0:B],  extra)
    h1 = H(h0,        tokens[B:2B], extra)
    ...

so equal hashes mean equal prefixes, and a prefix-cache lookup walks a request's hashes
until the first miss. ``H`` is sha256 over a canonical byte encoding, so hashes are
stable across processes and machines (KV connectors use them as storage keys); Python's
``hash()`` is salted per process and is never used.

Encoding of one block (all integers little-endian)::

    parent (32 bytes) | num_tokens (u64) | token ids (int64 each) | extra keys (tagged)
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

NONE_HASH = BlockHash(hashlib.sha256(b"halserve.kv_cache.NONE_HASH.v1").digest())
"""Parent of a request's first block (a fixed root, the same in every process)."""

ExtraKeys = object
"""None, or a (nested) tuple of int / str / bytes / bool / None: e.g. a LoRA name or
multimodal content hashes that make equal token ids mean different K/V."""


def _encode_extra(value: object, out: bytearray) -> None:
    # Tagged, length-prefixed, so distinct values never share an encoding.
    if value is None:
        out += b"N"
    elif isinstance(value, bool):
        out += b"T" if value else b"F"
    elif isinstance(value, int):
        digits = str(value).encode()
        out += b"I" + struct.pack("<I", len(digits)) + digits
    elif isinstance(value, str):
        data = value.encode("utf-8")
        out += b"S" + struct.pack("<I", len(data)) + data
    elif isinstance(value, bytes):
        out += b"B" + struct.pack("<I", len(value)) + value
    elif isinstance(value, (tuple, list)):
        out += b"L" + struct.pack("<I", len(value))
        for item in value:
            _encode_extra(item, out)
    else:
        raise ValueError(
            f"block hash extra key {value!r} of type {type(value).__name__} cannot be hashed "
            "stably; use None or tuples of int, str, bytes and bool"
        )


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: object = None
) -> BlockHash:
    """Hash of one block given its parent's hash (None: first block of a request)."""
    parent = NONE_HASH if parent_hash is None else parent_hash
    assert len(parent) == 32, "block hashes are sha256 digests"
    payload = bytearray(parent)
    payload += struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids)
    _encode_extra(extra_keys, payload)
    return BlockHash(hashlib.sha256(payload).digest())


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    num_tokens: int | None = None,
    extra_keys: object = None,
) -> list[BlockHash]:
    """Append the hashes of the full blocks in ``token_ids[:num_tokens]`` not yet in
    ``block_hashes`` (in place; also returned). Partial tail blocks are never hashed.
    ``extra_keys`` may be a function of a block's token span ``(start, end)`` (per-block keys,
    e.g. the images a block's tokens stand for)."""
    end = len(token_ids) if num_tokens is None else num_tokens
    assert end <= len(token_ids)
    num_full = end // block_size
    for i in range(len(block_hashes), num_full):
        parent = block_hashes[i - 1] if i else None
        start = i * block_size
        keys = extra_keys(start, start + block_size) if callable(extra_keys) else extra_keys
        block_hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size], keys))
    return block_hashes


def hash_request_tokens(block_size: int, token_ids: Sequence[int], extra_keys: object = None) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``."""
    return extend_block_hashes([], token_ids, block_size, extra_keys=extra_keys)
