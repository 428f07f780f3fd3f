"""Triton kernels of the ``triton_paged`` backend: cache write, unified attention, split reduce.

Imported only by ``triton_paged.py`` at first use: this module imports triton, which
``import halserve`` and ``halserve plugins`` must never do.

Cache layout (the base class default), one tensor per layer::

    kv_cache [2, num_blocks, block_size, num_kv_heads, head_size]   kv_cache[0] = K, kv_cache[1] = V
    slot s  = block_id * block_size + offset  ->  kv_cache[:, s // block_size, s % block_size]

Unified attention grid: ``(num_q_tiles, num_kv_heads, num_splits)``.

* A *q tile* is up to ``BLOCK_Q`` consecutive query tokens of ONE request times the
  ``NUM_QPK`` query heads that share one KV head (GQA packing), laid out as
  ``BLOCK_M = BLOCK_Q * NUM_QPK`` rows (padded up to a power of two), so both matmuls of
  the tile are ``tl.dot``\\ s and each K/V tile is loaded once for all heads of the group.
* Tile ids are assigned without a host sync (as vLLM's unified attention does): request r
  owns tile ids ``query_start_loc[r] // BLOCK_Q + r + i`` for ``i < cdiv(query_len_r, BLOCK_Q)``.
  Since ``floor((a + L) / B) + 1 >= floor(a / B) + cdiv(L, B)``, the ranges of consecutive
  requests never overlap, and ``T // BLOCK_Q + R`` tile ids cover every request; ids that
  fall in a gap exit at once. A program finds its request by binary search.
* ``num_splits > 1`` (split-K, "3D") divides each tile's KV range between programs that
  write unnormalised partial results; ``reduce_splits_kernel`` merges them. Used for
  decode batches with long contexts, where (requests x kv heads) alone cannot fill the GPU.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# -- cache write --------------------------------------------------------------------------


@triton.jit
def write_kv_cache_kernel(
    k_ptr,  # [T, num_kv_heads, head_size]
    v_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int64; negative = padding token, skipped
    k_scale,
    v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    # One program per token: all its kv heads at once ([HEADS_PAD, HEAD_PAD] tile).
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_SIZE)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    if IS_FP8:
        # quantize: x / scale, correctly rounded as torch divides (a plain `/` is div.full.f32 on
        # NVIDIA, up to 2 ulp off), saturated to the fp8 range (a plain cast would give nan/inf)
        k = tl.clamp(tl.math.div_rn(k.to(tl.float32), k_scale), -FP8_MAX, FP8_MAX)
        v = tl.clamp(tl.math.div_rn(v.to(tl.float32), v_scale), -FP8_MAX, FP8_MAX)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor,  # [T, num_kv_heads, head_size]
    v: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    num_tokens, num_kv_heads, head_size = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    is_fp8 = key_cache.dtype in FP8_DTYPES
    fp8_max = float(torch.finfo(key_cache.dtype).max) if is_fp8 else 0.0
    write_kv_cache_kernel[(num_tokens,)](
        k, v, key_cache, value_cache, slot_mapping, float(k_scale), float(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size),
        BLOCK_SIZE=key_cache.shape[1],
        IS_FP8=is_fp8,
        FP8_MAX=fp8_max,
    )


# -- unified attention --------------------------------------------------------------------


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q: tl.constexpr):
    # the last r with query_start_loc[r] // BLOCK_Q + r <= tile (the first tile id of r)
    left = 0
    right = num_reqs
    while left < right:
        mid = (left + right) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _tanh(x):
    # tanh without libdevice (the interpreter has none): 1 - 2 / (e^2x + 1); saturates cleanly
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def unified_attention_kernel(
    out_ptr,  # [T, num_heads, head_size]
    q_ptr,  # [T, num_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,
    block_table_ptr,  # [R, max_blocks_per_req] int32
    seq_lens_ptr,  # [R] int32
    query_start_loc_ptr,  # [R + 1] int32
    part_out_ptr,  # [T, num_heads, NUM_SPLITS, HEAD_PAD] fp32 (split path only)
    part_ml_ptr,  # [2, T, num_heads, NUM_SPLITS] fp32: running max, running sum
    scale,  # softmax scale (times k_scale for an fp8 cache)
    v_scale,
    soft_cap,
    num_reqs,
    num_tokens,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    NUM_QPK: tl.constexpr,  # query heads per kv head
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,  # keys per inner iteration (may span several cache blocks)
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= BLOCK_Q * NUM_QPK, a power of two >= 16
    SLIDING_WINDOW: tl.constexpr,  # 0: none
    USE_SOFT_CAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    req = _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    q_off = (tile - (q_begin // BLOCK_Q + req)) * BLOCK_Q  # first query index of this tile in req
    if q_off >= q_len:
        return  # a gap id between two requests' tile ranges
    seq_len = tl.load(seq_lens_ptr + req)
    prefix = seq_len - q_len  # positions already cached before this step

    # row m of the tile = query (q_off + m // NUM_QPK) of head (kv_head * NUM_QPK + m % NUM_QPK)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_n = tl.arange(0, TILE_N)
    q_idx = q_off + offs_m // NUM_QPK
    head = kv_head * NUM_QPK + offs_m % NUM_QPK
    row_ok = (offs_m // NUM_QPK < BLOCK_Q) & (q_idx < q_len)
    d_ok = offs_d < HEAD_SIZE
    q_pos = prefix + q_idx  # absolute position of each row's query

    q_tok = (q_begin + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_M, HEAD_PAD]

    # keys this tile can see: [kv_begin, kv_end); causal bound from its last query
    kv_end = prefix + tl.minimum(q_off + BLOCK_Q, q_len)
    kv_begin = 0
    if SLIDING_WINDOW > 0:
        kv_begin = tl.maximum(prefix + q_off - SLIDING_WINDOW + 1, 0)
    t_lo = kv_begin // TILE_N
    t_hi = tl.cdiv(kv_end, TILE_N)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(t_hi - t_lo, NUM_SPLITS)
        t_lo = t_lo + split * per_split
        t_hi = tl.minimum(t_lo + per_split, t_hi)

    # finite initial max: a row whose keys in this range are all masked stays exp(-inf) = 0, not nan
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for t in range(t_lo, t_hi):
        k_pos = t * TILE_N + offs_n  # [TILE_N]
        k_ok = k_pos < kv_end
        block = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        in_block = k_pos % BLOCK_SIZE
        k_t = tl.load(  # [HEAD_PAD, TILE_N]: K transposed, ready for q @ k_t
            k_cache_ptr + block[None, :] * stride_kb + in_block[None, :] * stride_ks
            + kv_head * stride_kh + offs_d[:, None],
            mask=d_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        s = tl.dot(q, k_t.to(tl.float32).to(DOT_DTYPE), input_precision="ieee") * scale  # [BLOCK_M, TILE_N]
        if USE_SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if SLIDING_WINDOW > 0:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(  # [TILE_N, HEAD_PAD]
            v_cache_ptr + block[:, None] * stride_vb + in_block[:, None] * stride_vs
            + kv_head * stride_vh + offs_d[None, :],
            mask=k_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(tl.float32).to(DOT_DTYPE), input_precision="ieee")
        m_i = m_new

    acc = acc * v_scale  # fp8 cache: V was stored as v / v_scale
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        # partials of (token, head, split); contiguous buffers allocated by the launcher
        row = (q_tok * NUM_HEADS + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_out_ptr + row[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + row, m_i, mask=row_ok)
        tl.store(part_ml_ptr + num_tokens * NUM_HEADS * NUM_SPLITS + row, l_i, mask=row_ok)


@triton.jit
def reduce_splits_kernel(
    out_ptr,  # [T, num_heads, head_size]
    part_out_ptr,  # [T, num_heads, NUM_SPLITS, HEAD_PAD]
    part_ml_ptr,  # [2, T, num_heads, NUM_SPLITS]
    num_tokens,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    # out = sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) l_s   with m = max_s m_s
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_PAD)
    row = (t.to(tl.int64) * NUM_HEADS + h) * NUM_SPLITS + offs_s  # [NUM_SPLITS]
    m = tl.load(part_ml_ptr + row)
    l = tl.load(part_ml_ptr + num_tokens * NUM_HEADS * NUM_SPLITS + row)
    acc = tl.load(part_out_ptr + row[:, None] * HEAD_PAD + offs_d[None, :])  # [NUM_SPLITS, HEAD_PAD]
    w = tl.exp(m - tl.max(m, axis=0))  # empty splits have m = -1e30 -> weight 0
    denom = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_SIZE,
    )


# -- launcher -----------------------------------------------------------------------------


def _dot_dtype(dtype: torch.dtype):
    # The interpreter computes bf16 (and fp16 dots) wrongly or slowly: it gets fp32 operands.
    # On a GPU, 16-bit models feed the tensor cores in their own dtype; fp32 stays ieee fp32.
    if _interpreting() or dtype == torch.float32:
        return tl.float32
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


def tile_sizes(
    num_queries_per_kv: int, max_query_len: int, head_size: int, dtype: torch.dtype
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_Q, TILE_N, num_warps) for a step.

    Decode-only steps use 16 rows (one token x the GQA group, tl.dot's minimum); steps with
    prefills use 64 rows (32 for fp32) so each K/V tile is reused by more queries. 64-row
    tiles take 8 warps (at 4 they spill registers on sm80/89 and gfx942).

    fp32 dots run on FMA units (ieee precision) with their operands in registers, at twice the
    width: 32-key tiles, and 16-key tiles for decode and for heads over 128; 32 rows take 8
    warps (a GQA-32 decode spilled 0.2 KB at 4). Wider fp32 tiles overflowed the shared
    memory of sm89 (99 KB: 100 KB for a 32 x 32 x 256 prefill tile) and MI300 (64 KB) or
    spilled registers (0.4 KB for a split decode at head 128, 6-7 KB at head 256 on sm_90).
    ``python -m halserve.platforms.triton_kernels.compile_check [--sweep]`` shows each build.
    """
    fp32 = dtype == torch.float32
    decode = max_query_len == 1
    rows = 16 if decode else 32 if fp32 else 64
    block_m = max(rows, triton.next_power_of_2(num_queries_per_kv))
    block_q = block_m // num_queries_per_kv
    if fp32:
        tile_n = 16 if decode or head_size > 128 else 32
    else:
        tile_n = 32 if head_size > 128 else 64
    num_warps = 8 if block_m >= 64 or (fp32 and block_m >= 32) else 4
    return block_m, block_q, tile_n, num_warps


DECODE_PIPELINE_STAGES = 5
"""``num_stages`` of split-K decode launches on NVIDIA sm_90 and later (compile-checked for sm_90).

Triton's pipeliner starts each load that feeds a dot ``(num_stages - 1) // (levels + 1)``
iterations ahead, where ``levels`` counts the loads in front of it: the K/V tiles sit behind
the block-table load, so Triton's default of 3 stages keeps them one iteration ahead in a
single buffer, and the loop waits for all its copies (``cp.async.wait_group 0``) before each
tile. 5 stages double-buffer K and V (``wait_group`` > 0: the next tile is in flight during
the dots), at 72 KB of shared memory per program for head size 128 (3 programs per SM).

Measured on an H200 (``bench_paged_attention.py --grid``, BENCHMARKS.md): split launches,
whose programs stream a short stretch each, gain from the second buffer (batch 32 x 16K
context in 4 splits: 81.6% of peak at 5 stages, 74.8% at 3), while single-pass launches lose
(batch 64 x 4K: 65.8% at 5 against 83.7% at 3 and 84.1% at 4),
so single-pass decode keeps Triton's default. A100 and sm_86/89 keep it everywhere: there
the second buffer would halve the programs per SM (4 -> 2) or leave one (99 KB), and no
measurement says otherwise; so does AMD (its stream pipeliner counts stages differently).
"""


def pipeline_stages(max_query_len: int, num_splits: int = 1) -> int | None:
    """``num_stages`` for an attention launch on the active Triton target; None: Triton's default
    (everything but split-K decode on sm_90+; see ``DECODE_PIPELINE_STAGES``)."""
    if max_query_len != 1 or num_splits == 1 or _interpreting():
        return None
    driver = triton.runtime.driver.active
    return _decode_stages(id(driver), driver.get_current_device())


@functools.cache
def _decode_stages(driver_id: int, device: int) -> int | None:
    # once per (driver, device), not per launch: get_current_target queries the device
    # (the compile check's stand-in driver numbers its targets as devices)
    target = triton.runtime.driver.active.get_current_target()
    return DECODE_PIPELINE_STAGES if target.backend == "cuda" and target.arch >= 90 else None


def paged_attention(
    out: torch.Tensor,  # [T, num_heads, head_size], written
    q: torch.Tensor,  # [T, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [R, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [R] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    *,
    num_reqs: int,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_splits: int = 1,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of every query token of the step over the paged cache, into ``out``.

    ``num_stages`` None: ``pipeline_stages`` picks (a forced value serves benchmarks).
    """
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads = key_cache.shape[2]
    if num_tokens == 0 or num_reqs == 0:
        return out
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two (the reduce loads them as one tile), got {num_splits}")
    num_qpk = num_heads // num_kv_heads
    head_pad = triton.next_power_of_2(head_size)
    block_m, block_q, tile_n, num_warps = tile_sizes(num_qpk, max_query_len, head_size, q.dtype)
    is_fp8 = key_cache.dtype in FP8_DTYPES
    if num_splits > 1:
        part_out = torch.empty((num_tokens, num_heads, num_splits, head_pad), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((2, num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_ml = out  # unused (NUM_SPLITS == 1 never touches them)
    grid = (num_tokens // block_q + num_reqs, num_kv_heads, num_splits)
    stages = num_stages if num_stages is not None else pipeline_stages(max_query_len, num_splits)
    launch_options = {} if stages is None else {"num_stages": stages}
    unified_attention_kernel[grid](
        out, q, key_cache, value_cache, block_table, seq_lens, query_start_loc, part_out, part_ml,
        float(scale) * (float(k_scale) if is_fp8 else 1.0),
        float(v_scale) if is_fp8 else 1.0,
        float(logits_soft_cap or 0.0),
        num_reqs,
        num_tokens,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        NUM_HEADS=num_heads,
        NUM_QPK=num_qpk,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=key_cache.shape[1],
        TILE_N=tile_n,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        SLIDING_WINDOW=int(sliding_window or 0),
        USE_SOFT_CAP=bool(logits_soft_cap),
        DOT_DTYPE=_dot_dtype(q.dtype),
        NUM_SPLITS=num_splits,
        num_warps=num_warps,
        **launch_options,
    )
    if num_splits > 1:
        reduce_splits_kernel[(num_tokens, num_heads)](
            out, part_out, part_ml, num_tokens, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_SIZE=head_size, HEAD_PAD=head_pad, NUM_SPLITS=num_splits,
        )
    return out
