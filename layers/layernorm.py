"""RMSNorm through the ``rms_norm`` kernel, with the fused pre-norm residual add; Gemma's (1 + w) variant."""
from __future__ import annotations

import torch
import torch.nn.functional as F
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


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``normed(x) * (1 + w)`` where checkpoints store ``w``; same call forms as RMSNorm.

    The parameter holds ``1 + w`` in float32, filled once at load: HF computes ``1.0 + w.float()``
    on every call, the same float32 value. A float32 model then is exactly RMSNorm with that
    weight, so the resolved (fused residual-add) kernel runs it. In half precision HF scales by
    ``1 + w`` in float32 *before* rounding to the model dtype, while the ``rms_norm`` op rounds
    first (Llama's order), and ``1 + w`` itself would lose bits in bfloat16: there it is computed
    in float32 here, as HF does.
    """

    def __init__(self, hidden_size: int, eps: float, ctx: ModelContext) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.model_dtype = ctx.dtype
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.kernel = None
        if ctx.dtype == torch.float32:
            self.kernel = resolve_kernel("rms_norm", ctx.platform_name, dtype="float32", hidden_size=hidden_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != param.shape:
            raise ValueError(f"Gemma norm checkpoint tensor has shape {tuple(loaded.shape)}, "
                             f"expected ({self.hidden_size},)")
        # through the model dtype first: HF holds w in it before its float32 (1 + w)
        param.data.copy_(1.0 + loaded.to(self.model_dtype).float())

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # x [T, hidden_size] (or [T * heads, head_size] for per-head q/k norms)
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        out = F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
