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

_FNUZ = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)  # AMD flavours: exponent bias one higher


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
def _fp8_bits_to_f16(bits, IS_E5: tl.constexpr, EXP_BIAS: tl.constexpr):
    # uint8 fp8 codes -> the same values in fp16, without fp8 types (pre-sm89 / pre-MI300
    # compilers reject them), by moving sign, exponent and mantissa into fp16's fields:
    #   e4m3: s eeee mmm -> s 0eeee mmm0000000, then x 2^(15 - bias) (a power of two: exact;
    #         fp8 subnormals land on fp16 subnormals, which the scaling makes normal)
    #   e5m2: s eeeee mm is the top byte of an fp16 (bias 15); e5m2fnuz (bias 16) halves that,
    #         except exponent 31 (finite in fnuz, inf/NaN in fp16), which steps down one instead
    # The NaN codes of the e4m3 flavours decode as finite values; quantized tensors never hold them.
    b = bits.to(tl.uint16)
    if IS_E5:
        h = b << 8
        if EXP_BIAS == 16:
            top = (b & 0x7C) == 0x7C
            f = tl.where(top, h - 0x400, h).to(tl.float16, bitcast=True).to(tl.float32)
            return tl.where(top, f, f * 0.5).to(tl.float16)
        return h.to(tl.float16, bitcast=True)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return (h.to(tl.float16, bitcast=True).to(tl.float32) * (2.0 ** (15 - EXP_BIAS))).to(tl.float16)


@triton.jit
def scaled_gemm_kernel(
    a_ptr, b_ptr, out_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_om, stride_on,
    PER_TOKEN: tl.constexpr,  # scale_a has M entries (else 1)
    PER_CHANNEL: tl.constexpr,  # scale_b has N entries (else 1)
    HAS_BIAS: tl.constexpr,
    IS_INT8: tl.constexpr,
    UPCAST: tl.constexpr,  # a and b are fp8 codes as uint8, decoded to fp16 (GPUs without fp8 tensor cores)
    FP8_IS_E5: tl.constexpr,  # UPCAST only: e5m2 codes (else e4m3)
    FP8_EXP_BIAS: tl.constexpr,  # UPCAST only: 7 e4m3fn, 8 e4m3fnuz, 15 e5m2, 16 e5m2fnuz
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
        elif UPCAST:  # fp8 values are exact in fp16
            acc += tl.dot(_fp8_bits_to_f16(a, FP8_IS_E5, FP8_EXP_BIAS), _fp8_bits_to_f16(b, FP8_IS_E5, FP8_EXP_BIAS))
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
    if a.dtype != b.dtype:
        raise ValueError(f"a is {a.dtype} but b is {b.dtype}; quantize both to the same dtype")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    # scales as flat fp32 vectors: [M, 1] / [M] / [1] -> [M] or [1]
    scale_a = scale_a.reshape(-1).to(torch.float32).contiguous()
    scale_b = scale_b.reshape(-1).to(torch.float32).contiguous()
    tiles = gemm_tiles(m, n, k)
    grid = (triton.cdiv(m, tiles["BLOCK_M"]) * triton.cdiv(n, tiles["BLOCK_N"]),)
    is_int8 = a.dtype == torch.int8
    upcast = upcast and not is_int8
    fp8_is_e5 = a.dtype in (torch.float8_e5m2, torch.float8_e5m2fnuz)
    fp8_bias = (16 if fp8_is_e5 else 8) if a.dtype in _FNUZ else (15 if fp8_is_e5 else 7)
    if upcast:  # the kernel decodes the codes itself
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    scaled_gemm_kernel[grid](
        a, b, out, scale_a, scale_b, bias if bias is not None else out,
        m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        PER_TOKEN=scale_a.numel() > 1,
        PER_CHANNEL=scale_b.numel() > 1,
        HAS_BIAS=bias is not None,
        IS_INT8=is_int8,
        UPCAST=upcast,
        FP8_IS_E5=fp8_is_e5,
        FP8_EXP_BIAS=fp8_bias,
        **tiles,
    )
    return out
