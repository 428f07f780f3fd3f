"""LLaVA (llava-1.5 style): a CLIP vision tower and a two-layer projector in front of a Llama-family
decoder.

    pixel_values [N, 3, S, S]
      vision_tower (clip.py)            hidden states of vision_feature_layer(s)   [N, 1 + P, Dv] each
      vision_feature_select_strategy    "default": drop the CLS token; "full": keep it
      concatenate the feature layers    [N, tokens, Dv * num_layers]
      multi_modal_projector             linear_1 -> projector_hidden_act -> linear_2   [N, tokens, H]

The prompt holds ``tokens`` image placeholder tokens per image (``num_image_tokens``); the caller
embeds the text (``embed_input_ids``), puts the image rows (``embed_images``) at the placeholder
positions and runs the decoder on those embeddings (``forward(..., inputs_embeds=...)``).

The vision tower and projector are plain torch modules, replicated on every tensor-parallel rank;
under pipeline parallelism only the first stage holds them.

Checkpoint names, both schemes loaded (the tower's under ``vision_model.`` in llava-hf's Hub
checkpoints, directly in what transformers 5 writes):

    llava-hf on the Hub, transformers' save         newer
    language_model.model.*                          model.language_model.*
    language_model.lm_head.*                        lm_head.*
    vision_tower.[vision_model.]*                   model.vision_tower.[vision_model.]*
    multi_modal_projector.*                         model.multi_modal_projector.*
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from halserve.distributed import get_pp_state
from halserve.layers import ModelContext
from halserve.layers.linear import vision_linear
from halserve.models.clip import CLIPVisionModel
from halserve.models.llama import LlamaForCausalLM
from halserve.models.pipeline import PPMissingLayer
from halserve.models.vision_language import VisionLanguageModel
from halserve.models.vision_layers import feature_layer_index, get_activation

TEXT_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # decoders of LlamaForCausalLM
VISION_MODEL_TYPES = ("clip_vision_model",)
SELECT_STRATEGIES = ("default", "full")

# newer checkpoint name prefix -> ours (the left column above)
_RENAMES = [
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
]


def _feature_layers(hf_config: Any) -> list[int]:
    layers = getattr(hf_config, "vision_feature_layer", -2)
    return [int(x) for x in layers] if isinstance(layers, (list, tuple)) else [int(layers)]


def _select_strategy(hf_config: Any) -> str:
    strategy = getattr(hf_config, "vision_feature_select_strategy", "default")
    if strategy not in SELECT_STRATEGIES:
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported; use one of "
                         f"{', '.join(SELECT_STRATEGIES)}")
    return strategy


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelContext, in_features: int) -> None:
        super().__init__()
        hidden = hf_config.text_config.hidden_size
        bias = bool(getattr(hf_config, "multimodal_projector_bias", True))
        self.linear_1 = vision_linear(in_features, hidden, ctx, bias=bias)
        self.act = get_activation(getattr(hf_config, "projector_hidden_act", "gelu"), "projector_hidden_act")
        self.linear_2 = vision_linear(hidden, hidden, ctx, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(VisionLanguageModel):
    """The model-module protocol of ``LlamaForCausalLM`` plus, for the model runner's multimodal path:

    supports_multimodal -> True (class attribute)
    image_token_id(hf_config) -> int (class method, cheap: config only)
    split_image_inputs(hf_config, processed, num_images) -> one dict of model inputs per image, from
        the checkpoint's image processor's batched output (class method)
    num_image_tokens(hf_config, image_inputs) -> its placeholder tokens (class method)
    embed_input_ids(input_ids [T]) -> [T, H]
    embed_multimodal(items) -> [num_image_tokens, H] per item, in the model dtype
    embed_images(pixel_values [N, 3, S, S]) -> [N, num_image_tokens, H] (LLaVA's batched form)
    """

    CHECKPOINT_RENAMES = _RENAMES  # (read by map_checkpoint_name)
    # our names of the first stage's non-decoder tensors (loaded by _load_vision_weight)
    VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")

    def __init__(self, hf_config: Any, ctx: ModelContext) -> None:
        super().__init__()
        self.config = hf_config
        text_config, vision_config = hf_config.text_config, hf_config.vision_config
        text_type = getattr(text_config, "model_type", None)
        if text_type not in TEXT_MODEL_TYPES:
            raise ValueError(f"LLaVA with a {text_type!r} language model is not supported; its text_config "
                             f"model_type must be one of {', '.join(TEXT_MODEL_TYPES)}")
        vision_type = getattr(vision_config, "model_type", None)
        if vision_type not in VISION_MODEL_TYPES:
            raise ValueError(f"LLaVA with a {vision_type!r} vision tower is not supported; its vision_config "
                             f"model_type must be one of {', '.join(VISION_MODEL_TYPES)}")
        self.feature_layers = _feature_layers(hf_config)
        self.select_strategy = _select_strategy(hf_config)
        self.language_model = LlamaForCausalLM(text_config, ctx)
        if get_pp_state().is_first:
            # build the tower only up to its deepest feature layer
            num_layers = max(feature_layer_index(layer, vision_config.num_hidden_layers)
                             for layer in self.feature_layers)
            self.vision_tower = CLIPVisionModel(vision_config, ctx, num_layers)
            self.multi_modal_projector = LlavaMultiModalProjector(
                hf_config, ctx, vision_config.hidden_size * len(self.feature_layers))
        else:
            self.vision_tower = PPMissingLayer()
            self.multi_modal_projector = PPMissingLayer()

    @classmethod
    def split_image_inputs(cls, hf_config: Any, processed: Any, num_images: int) -> list[dict[str, torch.Tensor]]:
        """The image processor's ``pixel_values`` [N, 3, S, S] -> ``{"pixel_values": [3, S, S]}`` per image."""
        pixel_values = processed["pixel_values"]
        return [{"pixel_values": pixel_values[i]} for i in range(num_images)]

    @classmethod
    def num_image_tokens(cls, hf_config: Any, image_inputs: Any = None) -> int:
        """Placeholder tokens per image (the same for all): one per patch, plus the CLS token's with
        strategy "full"."""
        vision_config = hf_config.vision_config
        num_patches = (vision_config.image_size // vision_config.patch_size) ** 2
        return num_patches + (_select_strategy(hf_config) == "full")

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, S, S] (the image processor's) -> the rows [N, num_image_tokens, H] that
        replace each image's placeholder tokens (first pipeline stage)."""
        states = self.vision_tower.hidden_states(pixel_values, self.feature_layers)  # each [N, 1 + P, Dv]
        if self.select_strategy == "default":
            states = [s[:, 1:] for s in states]  # drop the CLS token
        features = torch.cat(states, dim=-1)  # [N, tokens, Dv * num_feature_layers]
        return self.multi_modal_projector(features)

    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Per image (``split_image_inputs``' dicts) its rows [num_image_tokens, H]; images of one pixel
        shape go through the tower together."""
        out: list[torch.Tensor | None] = [None] * len(items)
        by_shape: dict[tuple, list[int]] = {}
        for i, item in enumerate(items):
            by_shape.setdefault(tuple(item["pixel_values"].shape), []).append(i)
        device = self.multi_modal_projector.linear_1.weight.device
        for indices in by_shape.values():
            pixels = torch.stack([items[i]["pixel_values"] for i in indices]).to(device)
            for i, rows in zip(indices, self.embed_images(pixels)):
                out[i] = rows
        return out

    def _load_vision_weight(self, name: str, original: str, tensor: torch.Tensor) -> set[str]:
        if name.startswith("vision_tower."):
            relative = name.removeprefix("vision_tower.")
            names = self.vision_tower.load_weights([(relative, tensor)], original.removesuffix(relative))
            return {f"vision_tower.{n}" for n in names}
        return self._load_parameter(self.multi_modal_projector, "multi_modal_projector", name, original, tensor)
