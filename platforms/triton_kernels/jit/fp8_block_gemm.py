"""Block-wise ("fine-grained") fp8: per-token-group activation quantization and the block-scaled GEMM.

DeepSeek-V3 / Qwen3-FP8 checkpoints scale weights per Bn x Bk block and activations per
token per Bk input features (Bn = Bk = 128 in every released checkpoint):

    out[m, n] = sum over k-blocks j of  scale_a[m, j] * scale_b[n // Bn, j] * (a[m, jBk:(j+1)Bk] . b[n, jBk:(j+1)Bk])

The scales change along K, so unlike the per-token x per-channel GEMM they cannot wait for
the epilogue: each K tile (BLOCK_K divides Bk, so a tile lies in one k-block) is dotted in
fp32 and scaled before it is added to the accumulator.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from halserve.kernels.reference import check_block_scaled_operands
from halserve.platforms.triton_kernels.common import gemm_tiles, interpreting
from halserve.platforms.triton_kernels.jit.scaled_gemm import _FNUZ, _fp8_bits_to_f16, _swizzle


@triton.jit
def fp8_block_gemm_kernel(
    a_ptr, b_ptr, out_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_om, stride_on,
    stride_sam, stride_sak, stride_sbn, stride_sbk,
    GROUP_N: tl.constexpr,  # Bn: weight rows per scale_b row
    GROUP_K: tl.constexpr,  # Bk: input features per scale column; a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,  # a and b are fp8 codes as uint8, decoded to fp16 (GPUs without fp8 tensor cores)
    FP8_IS_E5: tl.constexpr,  # UPCAST only: e5m2 codes (else e4m3)
    FP8_EXP_BIAS: tl.constexpr,  # UPCAST only: 7 e4m3fn, 8 e4m3fnuz, 15 e5m2, 16 e5m2fnuz
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _swizzle(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak  # [BM, BK]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk  # [BK, BN] = b.T tile
    sa_ptrs = scale_a_ptr + offs_m.to(tl.int64) * stride_sam  # [BM] column 0 of scale_a
    sb_ptrs = scale_b_ptr + (offs_n // GROUP_N).to(tl.int64) * stride_sbn  # [BN] each column's block row
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        k_block = k0 // GROUP_K
        sa = tl.load(sa_ptrs + k_block * stride_sak, mask=m_ok, other=0.0)  # [BM]
        sb = tl.load(sb_ptrs + k_block * stride_sbk, mask=n_ok, other=0.0)  # [BN]
        if UPCAST:  # fp8 values are exact in fp16
            part = tl.dot(_fp8_bits_to_f16(a, FP8_IS_E5, FP8_EXP_BIAS), _fp8_bits_to_f16(b, FP8_IS_E5, FP8_EXP_BIAS))
        else:
            part = tl.dot(a, b)  # fp32 [BM, BN]
        acc += part * sa[:, None] * sb[None, :]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_block_gemm(a, b, scale_a, scale_b, block_size, out_dtype, bias=None, *, upcast: bool = False):
    """The ``fp8_block_scaled_gemm`` op (shapes in ``halserve.kernels.OPS``)."""
    block_n, block_k = check_block_scaled_operands(a, b, scale_a, scale_b, block_size)
    (m, k), n = a.shape, b.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    tiles = gemm_tiles(m, n, k)
    # a K tile must not straddle two k-blocks: BLOCK_K is a power of two, so it divides Bk
    # when Bk is one too and BLOCK_K <= Bk (the kernel class declines other Bk)
    tiles["BLOCK_K"] = min(tiles["BLOCK_K"], block_k)
    if block_k % tiles["BLOCK_K"]:
        raise ValueError(f"Bk={block_k} is not a multiple of the K tile {tiles['BLOCK_K']}; use a power of two >= 16")
    # fp8 tensor-core dots take K >= 32 (Hopper's wgmma k32; Triton refuses a smaller fp8 tl.dot):
    # a smaller K tile dots the codes decoded to fp16 instead, which holds every fp8 value exactly
    upcast = upcast or tiles["BLOCK_K"] < 32
    grid = (triton.cdiv(m, tiles["BLOCK_M"]) * triton.cdiv(n, tiles["BLOCK_N"]),)
    fp8_is_e5 = a.dtype in (torch.float8_e5m2, torch.float8_e5m2fnuz)
    fp8_bias = (16 if fp8_is_e5 else 8) if a.dtype in _FNUZ else (15 if fp8_is_e5 else 7)
    if upcast:  # the kernel decodes the codes itself
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    scale_a, scale_b = scale_a.to(torch.float32), scale_b.to(torch.float32)
    fp8_block_gemm_kernel[grid](
        a, b, out, scale_a, scale_b, bias if bias is not None else out,
        m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        scale_a.stride(0), scale_a.stride(1), scale_b.stride(0), scale_b.stride(1),
        GROUP_N=block_n, GROUP_K=block_k, HAS_BIAS=bias is not None,
        UPCAST=upcast, FP8_IS_E5=fp8_is_e5, FP8_EXP_BIAS=fp8_bias,
        **tiles,
    )
    return out


@triton.jit
def group_quant_kernel(
    x_ptr, q_ptr, scale_ptr,
    M, K,
    stride_xm, stride_xk, stride_qm, stride_sm,
    FP8_MAX: tl.constexpr,
    GROUP: tl.constexpr,  # G: input features per scale
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_G: tl.constexpr,  # G rounded up to a power of two
):
    # program (i, j): rows [i*BLOCK_M, (i+1)*BLOCK_M) of group j, i.e. columns [j*G, (j+1)*G) & < K
    group = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_g = tl.arange(0, BLOCK_G)
    offs_k = group * GROUP + offs_g
    mask = (offs_m[:, None] < M) & ((offs_g < GROUP) & (offs_k < K))[None, :]
    rows = offs_m[:, None].to(tl.int64)
    x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX), 1e-12)  # [BM]
    # correctly rounded, as torch divides (a plain `/` is div.full.f32 on NVIDIA: up to 2 ulp off)
    y = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + rows * stride_qm + offs_k[None, :], y.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + offs_m.to(tl.int64) * stride_sm + group, scale, mask=offs_m < M)


def per_token_group_quant(x: torch.Tensor, fp8: torch.dtype, group_size: int):
    """x [M, K] -> (q [M, K] fp8, scale [M, ceil(K/G)] fp32): the ``per_token_group_fp8_quant`` op."""
    if group_size < 1:
        raise ValueError(f"group_size must be a positive int (128 for DeepSeek-V3-style fp8), got {group_size}")
    m, k = x.shape
    num_groups = triton.cdiv(k, group_size)
    q = torch.empty((m, k), dtype=fp8, device=x.device)
    scale = torch.empty((m, num_groups), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scale
    block_g = triton.next_power_of_2(group_size)
    # GPU: ~2K elements per program; interpreter: fewer, larger programs (each costs ~ms in numpy)
    block_m = max(1, min(64 if interpreting() else 2048 // block_g, triton.next_power_of_2(m)))
    grid = (triton.cdiv(m, block_m), num_groups)
    group_quant_kernel[grid](
        x, q, scale, m, k, x.stride(0), x.stride(1), q.stride(0), scale.stride(0),
        FP8_MAX=float(torch.finfo(fp8).max), GROUP=group_size, BLOCK_M=block_m, BLOCK_G=block_g,
    )
    return q, scale
