"""Activation quantization to fp8 / int8, static (given scale) or dynamic per token.

One program per row, looping over K in BLOCK chunks: pass 1 finds the row's absmax (dynamic
only), pass 2 writes clamp(x / scale). Dynamic per-tensor scales reuse the per-row absmax
and take the max on the host side of the launch (one small reduction).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round_half_even(y):
    # torch.round semantics without libdevice: floor(y + 0.5), then ties that landed on an odd
    # integer step back (2.5 -> 3 -> 2, -2.5 -> -2 stays, 3.5 -> 4 stays)
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - y) == 0.5) & odd, r - 1.0, r)


@triton.jit
def row_absmax_kernel(x_ptr, amax_ptr, K, stride_xm, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    tl.store(amax_ptr + row, tl.max(amax, axis=0))


@triton.jit
def quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm,
    QMAX: tl.constexpr,  # 127 (int8) or the fp8 max
    DYNAMIC: tl.constexpr,  # per-token scale = max(absmax / QMAX, 1e-12), written to scale_ptr[row]
    IS_INT8: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if DYNAMIC:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), QMAX), 1e-12)
        tl.store(scale_ptr + row, scale)
    else:
        scale = tl.load(scale_ptr)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        # a correctly rounded division, as torch's: x * (1/scale) rounds differently, and so does
        # Triton's plain `/` on NVIDIA GPUs (div.full.f32, up to 2 ulp off: the compiled kernel
        # missed torch's fp8/int8 codes on a few values, H200 2026-11-27)
        y = tl.math.div_rn(x, scale)
        if IS_INT8:
            y = tl.clamp(_round_half_even(y), -128.0, 127.0)
        else:
            y = tl.clamp(y, -QMAX, QMAX)
        tl.store(q_ptr + row * stride_qm + offs, y.to(q_ptr.dtype.element_ty), mask=offs < K)


def _block(k: int) -> int:
    return min(triton.next_power_of_2(k), 1024)


def quantize(x: torch.Tensor, qdtype: torch.dtype, scale: torch.Tensor | None, per_token: bool):
    """x [M, K] -> (q [M, K] qdtype, scale fp32 [M, 1] (dynamic per token) or [1])."""
    m, k = x.shape
    is_int8 = qdtype == torch.int8
    qmax = 127.0 if is_int8 else float(torch.finfo(qdtype).max)
    q = torch.empty((m, k), dtype=qdtype, device=x.device)
    if scale is None and not per_token:  # dynamic per-tensor: absmax of all rows, then static
        amax = torch.empty(m, dtype=torch.float32, device=x.device)
        if m:
            row_absmax_kernel[(m,)](x, amax, k, x.stride(0), BLOCK=_block(k))
        scale = (amax.amax() / qmax).clamp(min=1e-12).reshape(1) if m else torch.ones(1, device=x.device)
    dynamic = scale is None
    if dynamic:
        scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    else:
        scale = scale.reshape(-1).to(torch.float32)
        if scale.numel() != 1:
            raise ValueError(f"a static scale must have one element, got shape {list(scale.shape)}")
    if m:
        quantize_rows_kernel[(m,)](
            x, q, scale, k, x.stride(0), q.stride(0),
            QMAX=qmax, DYNAMIC=dynamic, IS_INT8=is_int8, BLOCK=_block(k),
        )
    return q, scale
