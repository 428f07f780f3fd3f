"""The flash_attn backend's glue: what it hands ``flash_attn_varlen_func`` and what it makes of the answer.

flash-attn cannot be built here (it compiles against a CUDA toolkit), so the CPU tests put
a stand-in module named ``flash_attn`` in ``sys.modules``: a dense torch implementation of
the documented contract of ``flash_attn_varlen_func`` with a paged cache (flash-attn 2.6
README and ``mha_varlen_fwd``): K/V as ``[num_blocks, page_block_size, kv_heads, head]``
read through ``block_table``, ``page_block_size % 256 == 0``, fp16/bf16 only, int32
``cu_seqlens``; "query i attends keys [i + Sk - Sq - left, i + Sk - Sq + right]" with
``causal`` the bottom-right-aligned ``right = 0``; ``softcap * tanh(s / softcap)`` on the
scaled scores. It checks those preconditions the way the CUDA kernel does and computes the
answer from them alone, so these tests show the backend writes the cache, converts the
batch metadata and the window correctly and pads its output; not that flash-attn's kernel
is right (the ``gpu`` test does that where flash-attn is installed).
"""
from __future__ import annotations

import sys
import types

import pytest
import torch
from paged_batch import dense_reference, make_batch

from halserve.attention_backends.flash_attn import FlashAttnBackend

# prefix hit + chunk spanning a block boundary, a long decode, a fresh prompt (block size 256)
SPECS = [(300, 20), (530, 1), (0, 9)]


def _varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                      softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                      deterministic=False, return_attn_probs=False, block_table=None):
    assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype, \
        "FlashAttention only supports fp16 and bf16"
    assert block_table is not None and block_table.dtype == torch.int32, "block_table must have dtype torch.int32"
    assert k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32, "cu_seqlens must have dtype int32"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "last dimension must be contiguous"
    assert q.shape[1] % k.shape[2] == 0, "number of query heads must be a multiple of kv heads"
    assert len(window_size) == 2 and dropout_p == 0.0 and alibi_slopes is None and not return_attn_probs
    batch = cu_seqlens_q.numel() - 1
    assert cu_seqlens_k.numel() == batch + 1 and block_table.shape[0] == batch
    assert int(cu_seqlens_q[-1]) == q.shape[0], "cu_seqlens_q must end at the number of query tokens"
    left, right = window_size
    if causal:
        right = 0
    page = k.shape[1]
    group = q.shape[1] // k.shape[2]
    out = torch.empty_like(q)
    for b in range(batch):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        sk = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        sq = q1 - q0
        assert sq <= max_seqlen_q and sk <= max_seqlen_k, "max_seqlen smaller than a sequence"
        j = torch.arange(sk, device=q.device)
        pages = block_table[b, j // page].long()
        kk = k[pages, j % page].float().repeat_interleave(group, dim=1)  # [Sk, H, D]
        vv = v[pages, j % page].float().repeat_interleave(group, dim=1)
        s = torch.einsum("nhd,shd->hns", q[q0:q1].float(), kk) * softmax_scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(sq, device=q.device)[:, None] + sk - sq  # bottom-right alignment
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
        if right >= 0:
            keep &= j[None, :] <= i + right
        if left >= 0:
            keep &= j[None, :] >= i - left
        s = s.masked_fill(~keep, float("-inf"))
        out[q0:q1] = torch.einsum("hns,shd->nhd", s.softmax(-1), vv).to(q.dtype)
    return out


@pytest.fixture
def flash_attn_standin(monkeypatch):
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = _varlen_reference
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return module


@pytest.mark.parametrize("window,soft_cap,dtype", [(None, None, torch.bfloat16), (8, 30.0, torch.float16)])
def test_forward_matches_dense_attention(flash_attn_standin, window, soft_cap, dtype, device):
    batch = make_batch(SPECS, num_heads=8, num_kv_heads=2, head_size=128, block_size=256, dtype=dtype,
                       device=device, seed=4)
    backend = FlashAttnBackend(8, 128, 128**-0.5, 2, sliding_window=window, logits_soft_cap=soft_cap)
    out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata)
    # the step's K/V landed in their slots, nothing else moved
    assert torch.equal(batch.kv_cache.cpu(), batch.expected_cache.cpu())
    expected = dense_reference(batch, batch.expected_cache, scale=128**-0.5, sliding_window=window, soft_cap=soft_cap)
    torch.testing.assert_close(out.cpu().double(), expected, atol=3e-2, rtol=3e-2)


def test_padding_rows_are_zero_and_not_sent(flash_attn_standin, device):
    batch = make_batch([(5, 3)], num_heads=4, num_kv_heads=4, head_size=64, block_size=256, dtype=torch.float16,
                       device=device)
    backend = FlashAttnBackend(4, 64, 0.125, 4)
    pad = lambda x: torch.cat([x, torch.ones_like(x[:2])])  # noqa: E731 - two padding rows
    out = backend.forward(pad(batch.q), pad(batch.k), pad(batch.v), batch.kv_cache, batch.metadata)
    assert out.shape[0] == 5 and torch.all(out[3:] == 0)
    assert torch.equal(batch.kv_cache.cpu(), batch.expected_cache.cpu())  # padding wrote nothing
    expected = dense_reference(batch, batch.expected_cache, scale=0.125)
    torch.testing.assert_close(out[:3].cpu().double(), expected, atol=4e-3, rtol=4e-3)


def test_block_sizes_flash_attn_cannot_page_are_refused():
    reason = FlashAttnBackend.supports(dtype="bfloat16", head_size=128, block_size=16, kv_cache_dtype="auto")
    assert reason and "block size" in reason.lower() and "256" in reason


@pytest.mark.gpu
def test_real_flash_attn_matches_dense_attention(device):
    pytest.importorskip("flash_attn", reason="flash_attn is not installed (it builds against a CUDA toolkit)")
    if FlashAttnBackend.supports(dtype="bfloat16", head_size=128, block_size=256, kv_cache_dtype="auto"):
        pytest.skip(FlashAttnBackend.supports(dtype="bfloat16", head_size=128, block_size=256, kv_cache_dtype="auto"))
    batch = make_batch(SPECS, num_heads=8, num_kv_heads=2, head_size=128, block_size=256, dtype=torch.bfloat16,
                       device=device, seed=4)
    backend = FlashAttnBackend(8, 128, 128**-0.5, 2, sliding_window=100, logits_soft_cap=30.0)
    out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata)
    expected = dense_reference(batch, batch.expected_cache, scale=128**-0.5, sliding_window=100, soft_cap=30.0)
    torch.testing.assert_close(out.cpu().double(), expected, atol=3e-2, rtol=3e-2)
