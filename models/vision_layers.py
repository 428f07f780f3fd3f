"""Pieces the vision towers share (CLIP, InternViT, Qwen2-VL's): activations by config name, the
feature-layer index, an RMSNorm over any shape, the fc1 -> act -> fc2 MLP, and full (bidirectional)
attention. Plain torch in the model dtype; linear layers through ``vision_linear``."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from halserve.layers import ModelContext
from halserve.layers.linear import vision_linear

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def get_activation(name: str, what: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function a config names (``what`` says which setting, for the error)."""
    act = _ACTIVATIONS.get(name)
    if act is None:
        raise ValueError(f"{what} {name!r} is not supported; use one of {', '.join(sorted(_ACTIVATIONS))}")
    return act


def feature_layer_index(layer: int, num_hidden_layers: int) -> int:
    """``layer`` in transformers' ``hidden_states`` indexing (0 = embeddings, i = after encoder
    layer i, negative from the end) as an index in ``[0, num_hidden_layers]``."""
    index = layer + num_hidden_layers + 1 if layer < 0 else layer
    if not 0 <= index <= num_hidden_layers:
        raise ValueError(f"vision feature layer {layer} is out of range for a vision tower of {num_hidden_layers} "
                         f"layers; use {-num_hidden_layers - 1} .. {num_hidden_layers}")
    return index


class VisionRMSNorm(nn.Module):
    """RMSNorm over the last dim of any shape, computed in float32 as transformers' vision towers do
    (the decoder's ``halserve.layers.RMSNorm`` runs a platform kernel on [T, H] rows)."""

    def __init__(self, dim: int, eps: float, ctx: ModelContext) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=ctx.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)


class VisionMLP(nn.Module):
    """fc1 -> the named activation -> fc2 (CLIP's, InternViT's and Qwen2-VL's tower MLP)."""

    def __init__(self, dim: int, hidden: int, act: str, ctx: ModelContext) -> None:
        super().__init__()
        self.fc1 = vision_linear(dim, hidden, ctx)
        self.act = get_activation(act, "vision hidden_act")
        self.fc2 = vision_linear(hidden, dim, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Every token of a sequence sees every other (no mask): q, k, v [N, L, D] -> [N, L, D]."""
    n, seq, dim = q.shape
    q, k, v = (x.view(n, seq, num_heads, dim // num_heads).transpose(1, 2) for x in (q, k, v))  # [N, heads, L, d]
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, seq, dim)
