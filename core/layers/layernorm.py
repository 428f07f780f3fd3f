"""RMSNorm through the ``rms_norm`` kernel, with the fused pre-norm residual add."""
from __future__ import annotations

import torch
from torch import nn

from halserve.kernels import resolve_kernel
from halserve.layers.context import ModelContext


class RMSNorm(nn.Module):
    """``forward(x)`` -> normed x; ``forward(x, residual)`` -> (normed(x + residual), x + residual).

    The residual form lets a decoder layer carry the un-normed stream between layers
    without a separate add kernel.
    """

    def __init__(self, hidden_size: int, eps: float, ctx: ModelContext) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=ctx.dtype), requires_grad=False)
        self.kernel = resolve_kernel("rms_norm", ctx.platform_name, dtype=ctx.dtype_name, hidden_size=hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # x [T, hidden_size] (or [T * heads, head_size] for per-head q/k norms)
        return self.kernel(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
