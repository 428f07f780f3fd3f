"""Rotary position embedding (neox and gpt-j pairings, partial rotary_dim), one program per token.

For each head, the first R = rotary_dim dims are rotated in pairs (x1, x2) by the angle of
the token's position: neox pairs dim i with i + R/2, gpt-j pairs 2i with 2i + 1::

    o1 = x1 * cos - x2 * sin,   o2 = x2 * cos + x1 * sin,   cos, sin = cos_sin_cache[pos, :R/2], [pos, R/2:]

Dims R..head_size pass through (the outputs start as copies of q and k).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, stride_t, t, cos, sin, num_heads, HEAD_SIZE: tl.constexpr, HALF: tl.constexpr,
                  HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, IS_NEOX: tl.constexpr):
    h = tl.arange(0, HEADS_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    if IS_NEOX:
        i1 = i
        i2 = i + HALF
    else:
        i1 = 2 * i
        i2 = 2 * i + 1
    mask = (h < num_heads) & (i < HALF)
    base = x_ptr + t * stride_t + h * HEAD_SIZE
    x1 = tl.load(base + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + i2, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + i1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + i2, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr,
    num_q_heads, num_k_heads, stride_qt, stride_kt, stride_cs,
    HEAD_SIZE: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, IS_NEOX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    i = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, stride_qt, t, cos, sin, num_q_heads, HEAD_SIZE, HALF, Q_HEADS_PAD, HALF_PAD, IS_NEOX)
    _rotate_heads(k_ptr, stride_kt, t, cos, sin, num_k_heads, HEAD_SIZE, HALF, K_HEADS_PAD, HALF_PAD, IS_NEOX)


def rotary_embedding(positions, q, k, cos_sin_cache, head_size: int, is_neox: bool):
    # new, contiguous outputs: q [T, Hq * D], k [T, Hk * D]
    q_out = q.reshape(q.shape[0], -1).clone(memory_format=torch.contiguous_format)
    k_out = k.reshape(k.shape[0], -1).clone(memory_format=torch.contiguous_format)
    num_tokens = positions.shape[0]
    half = cos_sin_cache.shape[-1] // 2
    if num_tokens:
        num_q, num_k = q_out.shape[1] // head_size, k_out.shape[1] // head_size
        rotary_kernel[(num_tokens,)](
            positions, q_out, k_out, cos_sin_cache, num_q, num_k,
            q_out.stride(0), k_out.stride(0), cos_sin_cache.stride(0),
            HEAD_SIZE=head_size, HALF=half, HALF_PAD=triton.next_power_of_2(half),
            Q_HEADS_PAD=triton.next_power_of_2(num_q), K_HEADS_PAD=triton.next_power_of_2(num_k), IS_NEOX=is_neox,
        )
    return q_out.view(q.shape), k_out.view(k.shape)
