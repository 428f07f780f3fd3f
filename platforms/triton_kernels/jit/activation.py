"""Gated MLP activations: out[t, i] = act(x[t, i]) * x[t, I + i], computed in fp32, rounded once.

    silu_and_mul        act(g) = g * sigmoid(g)
    gelu_tanh_and_mul   act(g) = 0.5 g (1 + tanh(s)),  s = sqrt(2 / pi) (g + 0.044715 g^3)
                               = g * sigmoid(2 s)      (tanh(s) = 2 sigmoid(2 s) - 1)

The sigmoid form needs no tanh (tl.tanh is missing from some Triton versions, libdevice's
from the interpreter) and saturates safely: exp overflows to inf for very negative
arguments, and 1 / (1 + inf) is 0, never NaN.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gelu_tanh_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    # 1.5957691216057308 = 2 sqrt(2 / pi); a literal, since the interpreter promotes a global
    # constexpr float to a float64 numpy array that its exp then rejects
    out = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _gated(kernel, x: torch.Tensor) -> torch.Tensor:
    # [..., 2I] -> [..., I], one program per (row, BLOCK columns)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    inter = shape[-1] // 2
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(inter), 1024)
    if x2.shape[0]:
        kernel[(x2.shape[0], triton.cdiv(inter, block))](x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block)
    return out.reshape(*shape[:-1], inter)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _gated(silu_and_mul_kernel, x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _gated(gelu_tanh_and_mul_kernel, x)
