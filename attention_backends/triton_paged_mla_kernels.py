"""Triton kernels of the ``triton_paged`` backend's MLA path (DeepSeek-V2/V3): latent-cache write and
absorbed decode. Imported by ``triton_paged.py`` at first MLA use (this module imports triton).

Cache layout (``halserve.kv_cache.spec.MLASpec``), one tensor per layer::

    cache [num_blocks, block_size, r + dr]       row of slot s = cache[s // block_size, s % block_size]
          = | latent kv_c [r] | rotary key k_pe [dr] |   (fp8 caches hold row / k_scale)

Absorbed decode (every head attends over the same latent rows: MQA with one "kv head" whose keys are
the r + dr values of a row and whose values are its first r)::

    scores[h, j] = (q_lat[h] . kv_c[j] + q_pe[h] . k_pe[j]) * scale     q_lat = W_UK^T q_nope (torch)
    o_lat[h]     = sum_j softmax(scores[h])[j] * kv_c[j]                 out = W_UV o_lat      (torch)

Grid ``(num_tokens, cdiv(num_heads, BLOCK_H), num_splits)``: a program takes ``BLOCK_H`` heads of one
query token (16 rows, tl.dot's minimum) and streams the request's rows ``TILE_N`` at a time with an
online softmax. It finds the token's request by binary search over ``query_start_loc`` (no host sync,
so a decode step can be replayed from a graph) and returns at once for tokens of requests with more
than one query token: the backend runs those (prefills) on the expanded keys and values instead.
Split-K partials have the layout of ``triton_paged_kernels.reduce_splits_kernel``, which merges them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from halserve.attention_backends.triton_paged_kernels import FP8_DTYPES, _dot_dtype, reduce_splits_kernel


def _pad(n: int) -> int:
    """A power of two >= n and >= 16 (tl.dot's smallest inner dimension)."""
    return max(16, triton.next_power_of_2(n))


# -- cache write --------------------------------------------------------------------------


@triton.jit
def write_mla_cache_kernel(
    kv_c_ptr,  # [T, r]
    k_pe_ptr,  # [T, dr]
    cache_ptr,  # [num_blocks, block_size, r + dr]
    slot_mapping_ptr,  # [T] int64; negative = padding token, skipped
    k_scale,
    stride_ct, stride_pt, stride_cb, stride_cs,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    # One program per token: its latent, then its rotary key, into one cache row.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    row = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    offs_r = tl.arange(0, RANK_PAD)
    c = tl.load(kv_c_ptr + t * stride_ct + offs_r, mask=offs_r < RANK, other=0.0)
    if IS_FP8:  # x / scale correctly rounded, saturated (as write_kv_cache_kernel)
        c = tl.clamp(tl.math.div_rn(c.to(tl.float32), k_scale), -FP8_MAX, FP8_MAX)
    tl.store(row + offs_r, c.to(cache_ptr.dtype.element_ty), mask=offs_r < RANK)
    if ROPE > 0:
        offs_p = tl.arange(0, ROPE_PAD)
        p = tl.load(k_pe_ptr + t * stride_pt + offs_p, mask=offs_p < ROPE, other=0.0)
        if IS_FP8:
            p = tl.clamp(tl.math.div_rn(p.to(tl.float32), k_scale), -FP8_MAX, FP8_MAX)
        tl.store(row + RANK + offs_p, p.to(cache_ptr.dtype.element_ty), mask=offs_p < ROPE)


def write_mla_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: float = 1.0) -> None:
    """kv_c [T, r], k_pe [T, dr] -> ``cache`` [num_blocks, block_size, r + dr] rows at ``slot_mapping`` [T]."""
    num_tokens, rank = kv_c.shape
    rope = k_pe.shape[1]
    if num_tokens == 0:
        return
    assert kv_c.stride(-1) == 1 and k_pe.stride(-1) == 1 and cache.stride(-1) == 1
    assert cache.shape[-1] == rank + rope, (tuple(cache.shape), rank, rope)
    is_fp8 = cache.dtype in FP8_DTYPES
    write_mla_cache_kernel[(num_tokens,)](
        kv_c, k_pe, cache, slot_mapping, float(k_scale),
        kv_c.stride(0), k_pe.stride(0), cache.stride(0), cache.stride(1),
        RANK=rank, ROPE=rope, RANK_PAD=_pad(rank), ROPE_PAD=_pad(rope), BLOCK_SIZE=cache.shape[1],
        IS_FP8=is_fp8, FP8_MAX=float(torch.finfo(cache.dtype).max) if is_fp8 else 0.0,
    )


# -- absorbed decode ----------------------------------------------------------------------


@triton.jit
def _token_request(query_start_loc_ptr, num_reqs, t):
    # the last r with query_start_loc[r] <= t: the request owning token t (empty requests skipped)
    left = 0
    right = num_reqs
    while left < right:
        mid = (left + right) // 2
        if tl.load(query_start_loc_ptr + mid) <= t:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def mla_decode_kernel(
    out_ptr,  # [T, H, r] o_lat (rows of prefill tokens untouched)
    q_lat_ptr,  # [T, H, r]
    q_pe_ptr,  # [T, H, dr]
    cache_ptr,  # [num_blocks, block_size, r + dr]
    block_table_ptr,  # [R, max_blocks_per_req] int32
    seq_lens_ptr,  # [R] int32
    query_start_loc_ptr,  # [R + 1] int32
    part_out_ptr,  # [T, H, NUM_SPLITS, RANK_PAD] fp32 (split path only)
    part_ml_ptr,  # [2, T, H, NUM_SPLITS] fp32: running max, running sum
    scale,  # softmax scale (times k_scale for an fp8 cache)
    v_scale,  # k_scale for an fp8 cache (the latent is the value), else 1
    num_reqs,
    num_tokens,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_bt,
    NUM_HEADS: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program (tile rows), a power of two >= 16
    TILE_N: tl.constexpr,  # cache rows per inner iteration
    DOT_DTYPE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    t = tl.program_id(0)
    head_tile = tl.program_id(1)
    split = tl.program_id(2)
    req = _token_request(query_start_loc_ptr, num_reqs, t)
    if tl.load(query_start_loc_ptr + req + 1) - tl.load(query_start_loc_ptr + req) != 1:
        return  # a prefill token: the expanded path
    seq_len = tl.load(seq_lens_ptr + req)  # the decode query sits at seq_len - 1 and sees every row

    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < NUM_HEADS
    offs_r = tl.arange(0, RANK_PAD)
    offs_p = tl.arange(0, ROPE_PAD)
    offs_n = tl.arange(0, TILE_N)
    r_ok = offs_r < RANK
    t64 = t.to(tl.int64)
    q_lat = tl.load(q_lat_ptr + t64 * stride_qlt + heads[:, None] * stride_qlh + offs_r[None, :],
                    mask=h_ok[:, None] & r_ok[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_H, RANK_PAD]
    if ROPE > 0:
        q_pe = tl.load(q_pe_ptr + t64 * stride_qpt + heads[:, None] * stride_qph + offs_p[None, :],
                       mask=h_ok[:, None] & (offs_p[None, :] < ROPE), other=0.0).to(DOT_DTYPE)  # [BLOCK_H, ROPE_PAD]

    t_lo = 0
    t_hi = tl.cdiv(seq_len, TILE_N)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(t_hi, NUM_SPLITS)
        t_lo = split * per_split
        t_hi = tl.minimum(t_lo + per_split, t_hi)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)  # finite: an empty split stays exp(-inf) = 0
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], dtype=tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for tile in range(t_lo, t_hi):
        k_pos = tile * TILE_N + offs_n  # [TILE_N]
        k_ok = k_pos < seq_len
        block = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        rows = cache_ptr + block * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs  # [TILE_N] row pointers
        latent = tl.load(rows[:, None] + offs_r[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        latent = latent.to(tl.float32).to(DOT_DTYPE)  # [TILE_N, RANK_PAD]: keys (with k_pe) and values
        s = tl.dot(q_lat, tl.trans(latent), input_precision="ieee")  # [BLOCK_H, TILE_N]
        if ROPE > 0:
            rope_t = tl.load(rows[None, :] + RANK + offs_p[:, None], mask=(offs_p[:, None] < ROPE) & k_ok[None, :],
                             other=0.0).to(tl.float32).to(DOT_DTYPE)  # [ROPE_PAD, TILE_N]
            s += tl.dot(q_pe, rope_t, input_precision="ieee")
        s = tl.where(k_ok[None, :], s * scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), latent, input_precision="ieee")
        m_i = m_new

    acc = acc * v_scale
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + t64 * stride_ot + heads[:, None] * stride_oh + offs_r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & r_ok[None, :])
    else:
        row = (t64 * NUM_HEADS + heads) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(part_out_ptr + row[:, None] * RANK_PAD + offs_r[None, :], acc, mask=h_ok[:, None])
        tl.store(part_ml_ptr + row, m_i, mask=h_ok)
        tl.store(part_ml_ptr + num_tokens * NUM_HEADS * NUM_SPLITS + row, l_i, mask=h_ok)


def decode_tiles(dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_H, TILE_N, num_warps). 16 heads per program (tl.dot's minimum rows; DeepSeek-V3 on 8 ranks
    has 16) and 32 rows of 576 values per tile for 16-bit models (36 KB of shared memory, as vLLM's
    Triton MLA decode); fp32 dots take their operands in registers, so 16 rows."""
    return 16, 16 if dtype == torch.float32 else 32, 4


def mla_decode(
    out: torch.Tensor,  # [T, H, r] written for the tokens of requests with one query token
    q_lat: torch.Tensor,  # [T, H, r]
    q_pe: torch.Tensor,  # [T, H, dr]
    cache: torch.Tensor,  # [num_blocks, block_size, r + dr]
    block_table: torch.Tensor,  # [R, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [R] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    *,
    num_reqs: int,
    scale: float,
    k_scale: float = 1.0,
    num_splits: int = 1,
) -> torch.Tensor:
    """Absorbed MLA attention of every decode token of the step over the latent cache, into ``out``."""
    num_tokens, num_heads, rank = q_lat.shape
    rope = q_pe.shape[2]
    if num_tokens == 0 or num_reqs == 0:
        return out
    assert q_lat.stride(-1) == 1 and q_pe.stride(-1) == 1 and out.stride(-1) == 1 and cache.stride(-1) == 1
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two (the reduce loads them as one tile), got {num_splits}")
    block_h, tile_n, num_warps = decode_tiles(q_lat.dtype)
    rank_pad = _pad(rank)
    is_fp8 = cache.dtype in FP8_DTYPES
    if num_splits > 1:
        part_out = torch.empty((num_tokens, num_heads, num_splits, rank_pad), dtype=torch.float32, device=out.device)
        part_ml = torch.empty((2, num_tokens, num_heads, num_splits), dtype=torch.float32, device=out.device)
    else:
        part_out = part_ml = out  # unused
    grid = (num_tokens, triton.cdiv(num_heads, block_h), num_splits)
    mla_decode_kernel[grid](
        out, q_lat, q_pe, cache, block_table, seq_lens, query_start_loc, part_out, part_ml,
        float(scale) * (float(k_scale) if is_fp8 else 1.0),
        float(k_scale) if is_fp8 else 1.0,
        num_reqs, num_tokens,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), block_table.stride(0),
        NUM_HEADS=num_heads, RANK=rank, ROPE=rope, RANK_PAD=rank_pad, ROPE_PAD=_pad(rope),
        BLOCK_SIZE=cache.shape[1], BLOCK_H=block_h, TILE_N=tile_n, DOT_DTYPE=_dot_dtype(q_lat.dtype),
        NUM_SPLITS=num_splits, num_warps=num_warps,
    )
    if num_splits > 1:
        # (prefill tokens' rows get garbage here; the backend overwrites them with the expanded path)
        reduce_splits_kernel[(num_tokens, num_heads)](
            out, part_out, part_ml, num_tokens, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_SIZE=rank, HEAD_PAD=rank_pad, NUM_SPLITS=num_splits,
        )
    return out
