"""InternViT, InternVL's vision tower (what transformers' ``InternVLVisionModel`` computes).

    pixel_values [N, 3, S, S]     one tile each, at the tower's size S
      embeddings.patch_embeddings.projection (Conv2d, stride p, biased)   [N, P, D], P = (S/p)^2
      [cls_token; patches] + position_embeddings                          [N, 1 + P, D]   hidden_states[0]
      encoder.layer[i], pre-norm, both branches scaled per channel (layer scale):         hidden_states[i + 1]
          h = h + lambda_1 * attention(layernorm_before(h))   q/k/v_proj -> q_norm/k_norm (optional RMSNorm over
                                                              all heads) -> bidirectional SDPA -> projection_layer
          h = h + lambda_2 * mlp(layernorm_after(h))          fc1 -> hidden_act -> fc2
      layernorm (a LayerNorm without use_mean_pooling, else none)                          last_hidden_state

    norm_type "layer_norm": LayerNorm; "rms_norm": RMSNorm (both eps layer_norm_eps); the qk-norms: RMSNorm, eps 1e-6

InternVL reads one feature layer (``vision_feature_layer``): -1 is ``last_hidden_state`` (after ``layernorm``),
any other index a ``hidden_states`` entry (0 = embeddings, i = after layer i, negative from the end). Only the
layers up to it are built (``num_layers``); the checkpoint tensors of the others, and of ``layernorm`` when
it is not read, are skipped when loading.

Plain torch modules in the model dtype, replicated on every tensor-parallel rank (no sharding, quantization
or LoRA); the RMSNorms in float32 as transformers does.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from halserve.layers import ModelContext
from halserve.layers.linear import vision_linear
from halserve.models.vision_layers import VisionMLP, VisionRMSNorm, feature_layer_index, full_attention

QK_NORM_EPS = 1e-6  # transformers' InternVLVisionRMSNorm default (the qk-norms are built without the config's eps)
NORM_TYPES = ("layer_norm", "rms_norm")
_LAYER_NAME = re.compile(r"^encoder\.layer\.(\d+)\.")


def square_size(value: Any, what: str) -> int:
    """``image_size`` / ``patch_size``: an int or a square (height, width)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"InternVL vision {what} {list(value)} is not square; only square tiles are supported")
        value = value[0]
    return int(value)


def make_norm(config: Any, ctx: ModelContext) -> nn.Module:
    norm_type = getattr(config, "norm_type", "layer_norm")
    if norm_type not in NORM_TYPES:
        raise ValueError(f"InternVL vision norm_type {norm_type!r} is not supported; use one of "
                         f"{', '.join(NORM_TYPES)}")
    if norm_type == "rms_norm":
        return VisionRMSNorm(config.hidden_size, config.layer_norm_eps, ctx)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=ctx.dtype)


class InternVisionEmbeddings(nn.Module):
    def __init__(self, config: Any, ctx: ModelContext) -> None:
        super().__init__()
        dim = config.hidden_size
        self.image_size = square_size(config.image_size, "image_size")
        patch = square_size(config.patch_size, "patch_size")
        self.patch_embeddings = nn.Module()
        self.patch_embeddings.projection = nn.Conv2d(getattr(config, "num_channels", 3), dim, patch, stride=patch,
                                                     dtype=ctx.dtype)
        self.cls_token = nn.Parameter(torch.empty(1, 1, dim, dtype=ctx.dtype), requires_grad=False)
        self.position_embeddings = None
        if getattr(config, "use_absolute_position_embeddings", True):
            num_positions = (self.image_size // patch) ** 2 + 1
            self.position_embeddings = nn.Parameter(torch.empty(1, num_positions, dim, dtype=ctx.dtype),
                                                    requires_grad=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n, _, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"pixel_values of {height}x{width} pixels do not match the vision tower's "
                             f"{self.image_size}x{self.image_size} tiles; preprocess the images with the model's "
                             "image processor")
        projection = self.patch_embeddings.projection
        patches = projection(pixel_values.to(projection.weight.dtype)).flatten(2).transpose(1, 2)  # [N, P, D]
        hidden = torch.cat([self.cls_token.expand(n, 1, -1), patches], dim=1)  # [N, 1 + P, D]
        return hidden if self.position_embeddings is None else hidden + self.position_embeddings


class InternVisionAttention(nn.Module):
    def __init__(self, config: Any, ctx: ModelContext) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        if dim % self.num_heads:
            raise ValueError(f"vision hidden_size {dim} is not divisible by num_attention_heads {self.num_heads}")
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = vision_linear(dim, dim, ctx, bias=bias)
        self.k_proj = vision_linear(dim, dim, ctx, bias=bias)
        self.v_proj = vision_linear(dim, dim, ctx, bias=bias)
        self.projection_layer = vision_linear(dim, dim, ctx)
        self.use_qk_norm = bool(getattr(config, "use_qk_norm", False))
        if self.use_qk_norm:  # over the whole width (all heads together), before the split into heads
            self.q_norm = VisionRMSNorm(dim, QK_NORM_EPS, ctx)
            self.k_norm = VisionRMSNorm(dim, QK_NORM_EPS, ctx)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)  # [N, L, D]
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.projection_layer(full_attention(q, k, v, self.num_heads))  # every token sees its tile


class InternVisionLayer(nn.Module):
    def __init__(self, config: Any, ctx: ModelContext) -> None:
        super().__init__()
        dim = config.hidden_size
        self.layernorm_before = make_norm(config, ctx)
        self.attention = InternVisionAttention(config, ctx)
        self.layernorm_after = make_norm(config, ctx)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act, ctx)
        self.lambda_1 = nn.Parameter(torch.empty(dim, dtype=ctx.dtype), requires_grad=False)
        self.lambda_2 = nn.Parameter(torch.empty(dim, dtype=ctx.dtype), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.lambda_1 * self.attention(self.layernorm_before(hidden))
        return hidden + self.lambda_2 * self.mlp(self.layernorm_after(hidden))


class InternVisionModel(nn.Module):
    """``vision_config``: transformers' ``InternVLVisionConfig``; ``feature_layer``: the one layer read
    (``vision_feature_layer``), which decides how many layers are built."""

    def __init__(self, vision_config: Any, ctx: ModelContext, feature_layer: int = -1) -> None:
        super().__init__()
        self.num_hidden_layers = vision_config.num_hidden_layers
        self.feature_layer = int(feature_layer)
        num_layers = feature_layer_index(self.feature_layer, self.num_hidden_layers)
        self.embeddings = InternVisionEmbeddings(vision_config, ctx)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(InternVisionLayer(vision_config, ctx) for _ in range(num_layers))
        # transformers applies the final norm to last_hidden_state only: the feature layer -1
        self.has_layernorm = self.feature_layer == -1 and not getattr(vision_config, "use_mean_pooling", True)
        self.skips_layernorm = not getattr(vision_config, "use_mean_pooling", True) and not self.has_layernorm
        if self.has_layernorm:
            self.layernorm = nn.LayerNorm(vision_config.hidden_size, eps=vision_config.layer_norm_eps, dtype=ctx.dtype)
        self.skips_mask_token = bool(getattr(vision_config, "use_mask_token", False))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, S, S] -> the feature layer's hidden states [N, 1 + P, D]."""
        hidden = self.embeddings(pixel_values)
        for layer in self.encoder.layer:
            hidden = layer(hidden)
        return self.layernorm(hidden) if self.has_layernorm else hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], prefix: str = "") -> set[str]:
        """Checkpoint tensors named as in ``InternVLVisionModel`` -> the set of loaded parameter names of this
        module. ``prefix``: where the tower sits in the checkpoint (``"vision_tower."``), for error messages."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            match = _LAYER_NAME.match(name)
            if match and len(self.encoder.layer) <= int(match.group(1)) < self.num_hidden_layers:
                continue  # past the feature layer: not built
            if (name.startswith("layernorm.") and self.skips_layernorm) or (
                    name == "embeddings.mask_token" and self.skips_mask_token):
                continue  # not read (the final norm of a tower read earlier; the pre-training mask token)
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {prefix + name!r} has no matching parameter in "
                                 f"{type(self).__name__}; is this checkpoint's vision tower an InternViT?")
            if param.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {prefix + name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.data.copy_(tensor)
            loaded.add(name)
        return loaded
