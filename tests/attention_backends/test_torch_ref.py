"""TorchAttentionBackend against a naive per-request attention over dense K/V."""
from __future__ import annotations

import math

import pytest
import torch

from halserve.attention_backends.base import AttentionMetadata
from halserve.attention_backends.torch_ref import TorchAttentionBackend

BLOCK_SIZE = 4
HEAD_SIZE = 16


def naive_attention(q, k, v, context_len, scale, window=None, soft_cap=None):
    """q [Lq, Hq, D]; k, v [L, Hk, D] (the request's whole context) -> [Lq, Hq, D]."""
    lq, hq, _ = q.shape
    group = hq // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    q_pos = torch.arange(context_len, context_len + lq).unsqueeze(1)
    k_pos = torch.arange(k.shape[0]).unsqueeze(0)
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).to(q.dtype)


def run_step(query_lens, seq_lens, num_heads, num_kv_heads, *, window=None, soft_cap=None,
             kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, seed=0):
    """Build a random step (prefix K/V already cached, random non-contiguous blocks),
    run the backend, compare each request with naive attention over its dense K/V."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(query_lens)
    blocks_per_req = [math.ceil(s / BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scatter blocks across the pool
    block_table = torch.zeros(num_reqs, max(blocks_per_req), dtype=torch.int32)
    backend = TorchAttentionBackend(num_heads, HEAD_SIZE, HEAD_SIZE**-0.5, num_kv_heads, sliding_window=window,
                                    logits_soft_cap=soft_cap, kv_cache_dtype=kv_cache_dtype)
    cache_dtype = {"auto": torch.float32, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    kv_cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_SIZE),
                           dtype=cache_dtype)
    dense_k, dense_v, qs, ks, vs, slots = [], [], [], [], [], []
    for r in range(num_reqs):
        ids = [perm.pop() for _ in range(blocks_per_req[r])]
        block_table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        kr = torch.randn(seq_lens[r], num_kv_heads, HEAD_SIZE, generator=gen)
        vr = torch.randn(seq_lens[r], num_kv_heads, HEAD_SIZE, generator=gen)
        if cache_dtype != torch.float32:  # the oracle sees what the cache can hold
            kr = (kr / k_scale).to(cache_dtype).float() * k_scale
            vr = (vr / v_scale).to(cache_dtype).float() * v_scale
        dense_k.append(kr)
        dense_v.append(vr)
        ctx = seq_lens[r] - query_lens[r]
        pos_slots = [ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_lens[r])]
        for p in range(ctx):  # the cached prefix, written by earlier steps
            kv_cache[0].view(-1, num_kv_heads, HEAD_SIZE)[pos_slots[p]] = (kr[p] / k_scale).to(cache_dtype)
            kv_cache[1].view(-1, num_kv_heads, HEAD_SIZE)[pos_slots[p]] = (vr[p] / v_scale).to(cache_dtype)
        qs.append(torch.randn(query_lens[r], num_heads, HEAD_SIZE, generator=gen))
        ks.append(kr[ctx:])
        vs.append(vr[ctx:])
        slots += pos_slots[ctx:]
    starts = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    common = AttentionMetadata(
        num_actual_tokens=sum(query_lens), num_reqs=num_reqs, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=starts, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=starts, seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
    )
    meta = TorchAttentionBackend.build_metadata(common)
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), kv_cache, meta, k_scale, v_scale)
    for r in range(num_reqs):
        want = naive_attention(qs[r], dense_k[r], dense_v[r], seq_lens[r] - query_lens[r], HEAD_SIZE**-0.5,
                               window, soft_cap)
        got = out[starts[r] : starts[r + 1]]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=f"request {r}")
    return kv_cache, block_table, dense_k, dense_v


# decodes, a fresh prefill, decodes, a chunked prefill after a prefix hit, in mixed order
MIXED = dict(query_lens=[1, 7, 1, 5, 1, 1], seq_lens=[9, 7, 14, 11, 1, 21])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_mixed_batch_matches_naive(num_heads, num_kv_heads):
    run_step(**MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads)


def test_sliding_window():
    run_step(**MIXED, num_heads=4, num_kv_heads=2, window=5)


def test_logits_soft_cap():
    run_step(**MIXED, num_heads=4, num_kv_heads=2, soft_cap=2.0)


def test_soft_cap_with_window():
    run_step(**MIXED, num_heads=4, num_kv_heads=1, soft_cap=3.0, window=4)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache(kv_cache_dtype):
    run_step(**MIXED, num_heads=4, num_kv_heads=2, kv_cache_dtype=kv_cache_dtype, k_scale=0.5, v_scale=0.25)


def test_new_tokens_are_written_to_their_slots():
    kv_cache, block_table, dense_k, dense_v = run_step(query_lens=[3, 1], seq_lens=[3, 6], num_heads=2, num_kv_heads=2)
    for r, seq_len in enumerate([3, 6]):
        blocks = block_table[r].long()
        cached_k = kv_cache[0][blocks].flatten(0, 1)[:seq_len]
        cached_v = kv_cache[1][blocks].flatten(0, 1)[:seq_len]
        torch.testing.assert_close(cached_k, dense_k[r])
        torch.testing.assert_close(cached_v, dense_v[r])


def test_padded_tokens_are_ignored():
    backend = TorchAttentionBackend(2, HEAD_SIZE, 0.25, 2)
    kv_cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(2, BLOCK_SIZE, 2, HEAD_SIZE))
    q, k, v = (torch.randn(4, 2, HEAD_SIZE) for _ in range(3))  # 2 real tokens + 2 padding
    starts = torch.tensor([0, 2], dtype=torch.int32)
    lens = torch.tensor([2], dtype=torch.int32)
    meta = TorchAttentionBackend.build_metadata(AttentionMetadata(
        num_actual_tokens=2, num_reqs=1, max_query_len=2, max_seq_len=2, query_start_loc=starts, seq_lens=lens,
        block_table=torch.tensor([[1]], dtype=torch.int32), slot_mapping=torch.tensor([4, 5]),
        query_start_loc_cpu=starts, seq_lens_cpu=lens))
    out = backend.forward(q, k, v, kv_cache, meta)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert torch.equal(kv_cache[:, 0], torch.zeros_like(kv_cache[:, 0]))  # block 0 untouched


def test_bad_kv_cache_dtype():
    with pytest.raises(ValueError, match="fp9"):
        TorchAttentionBackend(2, HEAD_SIZE, 0.25, 2, kv_cache_dtype="fp9")
