"""The CLIP vision transformer (what transformers' ``CLIPVisionModel`` computes): LLaVA's vision tower.

    pixel_values [N, 3, S, S]
      patch_embedding (Conv2d, stride p, no bias)   [N, D, S/p, S/p] -> [N, P, D], P = (S/p)^2
      [class_embedding; patches] + position_embedding   [N, 1 + P, D]
      pre_layrnorm                                  hidden_states[0]
      encoder.layers[i]                             hidden_states[i + 1]   (pre-LN, bidirectional attention)
      post_layernorm                                on the CLS token only: the pooled output (``pool``)

A multimodal model reads the hidden states of a feature layer (transformers' ``hidden_states``
indexing above; negative counts from the end of the full tower), so only the layers up to the
deepest one it asks for are built (``num_layers``, as vLLM does); the checkpoint tensors of the
others, and of ``post_layernorm`` when the tower is cut short, are skipped when loading.

The tower is small next to the language model: plain torch modules in the model dtype,
replicated on every tensor-parallel rank (no sharding, quantization or LoRA).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from halserve.layers import ModelContext
from halserve.layers.linear import vision_linear
from halserve.models.vision_layers import VisionMLP, feature_layer_index, full_attention

_LAYER_NAME = re.compile(r"^encoder\.layers\.(\d+)\.")


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: Any, ctx: ModelContext) -> None:
        super().__init__()
        dim, self.image_size, self.patch_size = config.hidden_size, config.image_size, config.patch_size
        self.patch_embedding = nn.Conv2d(getattr(config, "num_channels", 3), dim, self.patch_size,
                                         stride=self.patch_size, bias=False, dtype=ctx.dtype)
        self.class_embedding = nn.Parameter(torch.empty(dim, dtype=ctx.dtype), requires_grad=False)
        num_positions = (self.image_size // self.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, dim, dtype=ctx.dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n, _, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"pixel_values of {height}x{width} pixels do not match the vision tower's "
                             f"{self.image_size}x{self.image_size}; resize the images with the model's image processor")
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype))  # [N, D, S/p, S/p]
        patches = patches.flatten(2).transpose(1, 2)  # [N, P, D]
        cls = self.class_embedding.expand(n, 1, -1)  # [N, 1, D]
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight  # [N, 1 + P, D]


class CLIPAttention(nn.Module):
    def __init__(self, config: Any, ctx: ModelContext) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        if dim % self.num_heads:
            raise ValueError(f"vision hidden_size {dim} is not divisible by num_attention_heads {self.num_heads}")
        self.q_proj = vision_linear(dim, dim, ctx)
        self.k_proj = vision_linear(dim, dim, ctx)
        self.v_proj = vision_linear(dim, dim, ctx)
        self.out_proj = vision_linear(dim, dim, ctx)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        return self.out_proj(full_attention(q, k, v, self.num_heads))  # every patch sees every patch


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: Any, ctx: ModelContext) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps, dtype=ctx.dtype)
        self.self_attn = CLIPAttention(config, ctx)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps, dtype=ctx.dtype)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act, ctx)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden))
        return hidden + self.mlp(self.layer_norm2(hidden))


class CLIPEncoder(nn.Module):
    def __init__(self, config: Any, ctx: ModelContext, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config, ctx) for _ in range(num_layers))


class CLIPVisionModel(nn.Module):
    """``vision_config``: transformers' ``CLIPVisionConfig``. ``num_layers``: how many encoder
    layers to build (None: all of them; then ``post_layernorm`` is built too)."""

    def __init__(self, vision_config: Any, ctx: ModelContext, num_layers: int | None = None) -> None:
        super().__init__()
        self.num_hidden_layers = vision_config.num_hidden_layers
        num_layers = self.num_hidden_layers if num_layers is None else num_layers
        if not 0 <= num_layers <= self.num_hidden_layers:
            raise ValueError(f"num_layers {num_layers} is out of range for a vision tower of "
                             f"{self.num_hidden_layers} layers")
        self.embeddings = CLIPVisionEmbeddings(vision_config, ctx)
        self.pre_layrnorm = nn.LayerNorm(vision_config.hidden_size, eps=vision_config.layer_norm_eps,
                                         dtype=ctx.dtype)
        self.encoder = CLIPEncoder(vision_config, ctx, num_layers)
        self.has_post_layernorm = num_layers == self.num_hidden_layers
        if self.has_post_layernorm:
            self.post_layernorm = nn.LayerNorm(vision_config.hidden_size, eps=vision_config.layer_norm_eps,
                                               dtype=ctx.dtype)

    @property
    def num_built_layers(self) -> int:
        return len(self.encoder.layers)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, S, S] -> the last built layer's output [N, 1 + P, D] (with every
        layer built: ``CLIPVisionModel``'s ``last_hidden_state``)."""
        return self.hidden_states(pixel_values, [self.num_built_layers])[0]

    def hidden_states(self, pixel_values: torch.Tensor, layers: Sequence[int]) -> list[torch.Tensor]:
        """The hidden states [N, 1 + P, D] after each of ``layers`` (``hidden_states`` indexing,
        negative from the end of the full tower), in that order; runs only the layers needed."""
        indices = [feature_layer_index(layer, self.num_hidden_layers) for layer in layers]
        if max(indices) > self.num_built_layers:
            raise ValueError(f"vision feature layers {list(layers)} need {max(indices)} encoder layers; "
                             f"this tower was built with {self.num_built_layers}")
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        states = {0: hidden}
        for i, layer in enumerate(self.encoder.layers[: max(indices)]):
            hidden = layer(hidden)
            states[i + 1] = hidden
        return [states[i] for i in indices]

    def pool(self, last_hidden_state: torch.Tensor) -> torch.Tensor:
        """``CLIPVisionModel``'s pooled output [N, D]: the final CLS state, normed (full tower only)."""
        if not self.has_post_layernorm:
            raise ValueError("this vision tower was built without its last layers; it has no pooled output")
        return self.post_layernorm(last_hidden_state[:, 0])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], prefix: str = "") -> set[str]:
        """Checkpoint tensors named as in ``CLIPVisionModel`` (optionally under ``vision_model.``)
        -> the set of loaded parameter names of this module. ``prefix``: where the tower sits in the
        checkpoint (``"vision_tower."``), for error messages."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = name.removeprefix("vision_model.")
            if target == "embeddings.position_ids":
                continue  # a buffer older checkpoints saved
            match = _LAYER_NAME.match(target)
            if match and int(match.group(1)) >= self.num_built_layers:
                continue  # past the deepest feature layer: not built
            if target.startswith("post_layernorm.") and not self.has_post_layernorm:
                continue
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {prefix + name!r} has no matching parameter in "
                                 f"{type(self).__name__}; is this checkpoint's vision tower a CLIP ViT?")
            if param.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {prefix + name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.data.copy_(tensor)
            loaded.add(target)
        return loaded
