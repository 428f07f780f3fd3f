"""W8A8 scaled GEMM for fp8 and int8: out = (a * scale_a) @ (b * scale_b).T + bias.

a [M, K], b [N, K] (nn.Linear layout), scale_a [M] (per token) or [1], scale_b [N] (per
channel) or [1]. Products accumulate in fp32 (fp8) or exactly in int32 (int8); the scales
are applied once, in the epilogue, since they are constant along K.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from halserve.platforms.triton_kernels.common import gemm_tiles


@triton.jit
def _swizzle(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # GROUP_M row-tiles walk their column-tiles together so B tiles are reused from L2
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    return pid_m, pid_n


@triton.jit
def scaled_gemm_kernel(
    a_ptr, b_ptr, out_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_om, stride_on,
    PER_TOKEN: tl.constexpr,  # scale_a has M entries (else 1)
    PER_CHANNEL: tl.constexpr,  # scale_b has N entries (else 1)
    HAS_BIAS: tl.constexpr,
    IS_INT8: tl.constexpr,
    UPCAST: tl.constexpr,  # fp8 operands are cast to fp16 first (GPUs without fp8 tensor cores)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _swizzle(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak  # [BM, BK]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk  # [BK, BN] = b.T tile
    if IS_INT8:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
        if IS_INT8:
            acc += tl.dot(a, b)  # int8 x int8 -> int32, exact
        elif UPCAST:
            acc += tl.dot(a.to(tl.float16), b.to(tl.float16))  # fp8 values are exact in fp16
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    out = acc.to(tl.float32)
    if PER_TOKEN:
        out *= tl.load(scale_a_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
    else:
        out *= tl.load(scale_a_ptr)
    if PER_CHANNEL:
        out *= tl.load(scale_b_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    else:
        out *= tl.load(scale_b_ptr)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def scaled_gemm(a, b, scale_a, scale_b, out_dtype, bias=None, *, upcast: bool = False) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k:
        raise ValueError(f"a is [{m}, {k}] but b is {list(b.shape)}; b must be [N, K]")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    # scales as flat fp32 vectors: [M, 1] / [M] / [1] -> [M] or [1]
    scale_a = scale_a.reshape(-1).to(torch.float32).contiguous()
    scale_b = scale_b.reshape(-1).to(torch.float32).contiguous()
    tiles = gemm_tiles(m, n, k)
    grid = (triton.cdiv(m, tiles["BLOCK_M"]) * triton.cdiv(n, tiles["BLOCK_N"]),)
    scaled_gemm_kernel[grid](
        a, b, out, scale_a, scale_b, bias if bias is not None else out,
        m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        PER_TOKEN=scale_a.numel() > 1,
        PER_CHANNEL=scale_b.numel() > 1,
        HAS_BIAS=bias is not None,
        IS_INT8=a.dtype == torch.int8,
        UPCAST=upcast,
        **tiles,
    )
    return out
