"""RMSNorm with the optional fused residual add, one program per token row."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    H, eps, stride_x, stride_r, stride_o, stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,  # 16-bit x: round the normalized row to x's dtype, then * weight
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the sum in x's dtype, like x + residual
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    if ROUND_BEFORE_WEIGHT:
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, h = x2.shape
    out = torch.empty_like(x2)
    res_in = residual.reshape(-1, h) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    if rows:
        block = triton.next_power_of_2(h)
        rms_norm_kernel[(rows,)](
            x2, res_in, weight, out, res_out, h, float(eps),
            x2.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None,
            ROUND_BEFORE_WEIGHT=x.dtype != torch.float32,
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )
    if residual is None:
        return out.reshape(shape)
    return out.reshape(shape), res_out.reshape(shape)
