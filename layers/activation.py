"""Gated activations."""
from __future__ import annotations

import torch
from torch import nn

from halserve.kernels import resolve_kernel
from halserve.layers.context import ModelContext


class SiluAndMul(nn.Module):
    """``x [T, 2I] -> silu(x[:, :I]) * x[:, I:]  [T, I]`` (the fused gate/up of SwiGLU MLPs)."""

    def __init__(self, intermediate_size: int, ctx: ModelContext) -> None:
        super().__init__()
        self.kernel = resolve_kernel("silu_and_mul", ctx.platform_name, dtype=ctx.dtype_name,
                                     intermediate_size=intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x)


class GeluAndMul(nn.Module):
    """``x [T, 2I] -> gelu_tanh(x[:, :I]) * x[:, I:]  [T, I]`` (GeGLU with the tanh approximation,
    HF's ``gelu_pytorch_tanh``, as Gemma's MLPs use)."""

    def __init__(self, intermediate_size: int, ctx: ModelContext) -> None:
        super().__init__()
        self.kernel = resolve_kernel("gelu_tanh_and_mul", ctx.platform_name, dtype=ctx.dtype_name,
                                     intermediate_size=intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x)
