"""Builds random mixed paged-attention batches and a dense reference for the Triton tests.

A batch is a list of ``(num_cached, query_len)`` per request: ``num_cached`` positions
are already in the cache (prefix hit or earlier chunks), ``query_len`` new tokens are
scheduled now (1 = decode). Blocks are handed out in a random order so block tables are
not the identity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from halserve.attention_backends.base import AttentionMetadata


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, KVH, D] new keys of this step
    v: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, KVH, D] with the prefixes already written
    expected_cache: torch.Tensor  # kv_cache after the step's K/V are written (torch indexing)
    metadata: AttentionMetadata
    specs: list[tuple[int, int]]


def make_batch(
    specs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    cache_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> PagedBatch:
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    seq_lens = [c + n for c, n in specs]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # spare blocks hold garbage nobody should read
    order = torch.randperm(num_blocks, generator=g)
    max_blocks = max(blocks_per_req)
    block_table = torch.zeros(len(specs), max_blocks, dtype=torch.int32)
    used = 0
    for r, nb in enumerate(blocks_per_req):
        block_table[r, :nb] = order[used : used + nb].to(torch.int32)
        used += nb
    # cache content: random everywhere (prefix K/V and garbage alike), in the cache dtype
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=g).to(cache_dtype)

    num_tokens = sum(n for _, n in specs)
    q = torch.randn(num_tokens, num_heads, head_size, generator=g).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_size, generator=g).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_size, generator=g).to(dtype)
    query_start_loc = torch.zeros(len(specs) + 1, dtype=torch.int32)
    slot_mapping = torch.empty(num_tokens, dtype=torch.int64)
    t = 0
    for r, (cached, n) in enumerate(specs):
        query_start_loc[r + 1] = query_start_loc[r] + n
        for i in range(n):
            pos = cached + i
            slot_mapping[t] = int(block_table[r, pos // block_size]) * block_size + pos % block_size
            t += 1
    expected = kv_cache.clone()
    flat = expected.view(2, -1, num_kv_heads, head_size)
    if cache_dtype == dtype:
        flat[0, slot_mapping] = k
        flat[1, slot_mapping] = v
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=len(specs),
        max_query_len=max(n for _, n in specs),
        max_seq_len=max(seq_lens),
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens_t.to(device),
        block_table=block_table.to(device),
        slot_mapping=slot_mapping.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_t,
    )
    return PagedBatch(q.to(device), k.to(device), v.to(device), kv_cache.to(device), expected.to(device), metadata, specs)


def dense_reference(
    batch: PagedBatch,
    cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D] holding every position of the step
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of every query over its request's cached positions, in float64, gathered densely."""
    md = batch.metadata
    cache = cache.cpu()
    block_table = md.block_table.cpu()
    q = batch.q.cpu().double()
    num_heads, num_kv_heads = q.shape[1], cache.shape[3]
    block_size = cache.shape[2]
    out = torch.empty_like(q)
    t = 0
    for r, (cached, n) in enumerate(batch.specs):
        seq_len = cached + n
        pos = torch.arange(seq_len)
        slots = block_table[r, pos // block_size].long() * block_size + pos % block_size
        flat = cache.view(2, -1, num_kv_heads, cache.shape[-1])
        kk = flat[0, slots].double() * k_scale  # [S, KVH, D]
        vv = flat[1, slots].double() * v_scale
        kk = kk.repeat_interleave(num_heads // num_kv_heads, dim=1)
        vv = vv.repeat_interleave(num_heads // num_kv_heads, dim=1)
        qq = q[t : t + n]  # [n, H, D]
        s = torch.einsum("nhd,shd->hns", qq, kk) * scale
        if soft_cap:
            s = soft_cap * torch.tanh(s / soft_cap)
        q_pos = cached + torch.arange(n)
        visible = pos[None, :] <= q_pos[:, None]
        if sliding_window:
            visible &= pos[None, :] > q_pos[:, None] - sliding_window
        s = s.masked_fill(~visible, float("-inf"))
        out[t : t + n] = torch.einsum("hns,shd->nhd", s.softmax(-1), vv)
        t += n
    return out
