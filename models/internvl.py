"""InternVL (transformers' native ``InternVLForConditionalGeneration``: InternVL3-*-hf): an InternViT tower
(``internvl_vision.py``), pixel shuffle and a projector in front of a Llama-family decoder (Qwen2 for InternVL3).

    image (any size)
      the image processor (GotOcr2's, ``crop_to_patches``) picks the grid of c x r tiles (min_patches <= c * r
      <= max_patches) whose aspect ratio is closest to the image's, resizes the image to it and cuts it into
      tiles of S x S pixels, row by row; with more than one it adds the whole image resized to S x S last
      (the thumbnail)                                                         pixel_values [tiles, 3, S, S]
      tower, per tile: the feature layer's hidden states, the CLS token dropped        [tiles, p, p, D]
      pixel shuffle (k = 1 / downsample_ratio): each k x k block of patches -> one token, its channels the
        block's rows i, then columns j, then D (transformers' order)                    [tiles, p/k, p/k, k*k*D]
      multi_modal_projector: LayerNorm -> linear_1 -> projector_hidden_act -> linear_2  [tiles * (p/k)^2, H]

    p = S / patch_size; num_image_tokens = tiles * (p / k)^2 (InternVL3: 256 per 448-pixel tile)

The prompt holds, per image, ``<img>`` + a run of ``num_image_tokens`` ``<IMG_CONTEXT>`` tokens + ``</img>``
(``InternVLProcessor`` writes it in place of each ``<IMG_CONTEXT>`` the chat template puts in the text); the
run is contiguous and its tokens take the image's rows in order: its tiles in the processor's order, each
tile's tokens row by row. The engine's expansion adds the ``<img>`` / ``</img>`` around each lone placeholder
(``image_token_wrappers``) and tiles as the processor does (``IMAGE_PROCESSOR_DEFAULTS``: the checkpoints'
preprocessor_config.json says ``crop_to_patches: false``, which ``InternVLProcessor`` overrides).

The vision tower and projector are plain torch modules, replicated on every tensor-parallel rank; under
pipeline parallelism only the first stage holds them. The LM head is tied to the embeddings when the
top-level config's ``tie_word_embeddings`` is set (its default, as transformers reads it).

Checkpoint names, both schemes loaded (LLaVA's; the tower directly under ``vision_tower.``):

    the Hub, transformers' save         newer (the module's own state dict)
    language_model.model.*              model.language_model.*
    language_model.lm_head.*            lm_head.*
    vision_tower.*                      model.vision_tower.*
    multi_modal_projector.*             model.multi_modal_projector.*
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from halserve.distributed import get_pp_state
from halserve.layers import ModelContext
from halserve.layers.linear import vision_linear
from halserve.models.internvl_vision import InternVisionModel, square_size
from halserve.models.llama import LlamaForCausalLM
from halserve.models.pipeline import PPMissingLayer
from halserve.models.vision_language import VisionLanguageModel
from halserve.models.vision_layers import get_activation

TEXT_MODEL_TYPES = ("llama", "qwen2", "qwen3")  # decoders of LlamaForCausalLM
VISION_MODEL_TYPES = ("internvl_vision",)
PROJECTOR_EPS = 1e-5  # the projector's LayerNorm (torch's default: transformers builds it without an eps)

# newer checkpoint name prefix -> ours (the Hub's column above)
_RENAMES = [
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
]


def feature_layer(hf_config: Any) -> int:
    layer = getattr(hf_config, "vision_feature_layer", -1)
    if isinstance(layer, (list, tuple)):
        raise ValueError(f"InternVL reads one vision_feature_layer, got {list(layer)}; give a single layer index")
    return int(layer)


def shuffle_factor(hf_config: Any) -> int:
    """k: pixel shuffle merges k x k patches into one token (``downsample_ratio`` = 1 / k)."""
    ratio = float(getattr(hf_config, "downsample_ratio", 0.5))
    k = round(1 / ratio) if ratio > 0 else 0
    patches = _patches_per_side(hf_config.vision_config)
    if k < 1 or abs(k * ratio - 1) > 1e-6 or patches % k:
        raise ValueError(f"downsample_ratio {ratio} is not 1 / k for a whole k dividing the tile's {patches} patches "
                         "per side; InternVL checkpoints use 0.5")
    return k


def _patches_per_side(vision_config: Any) -> int:
    return square_size(vision_config.image_size, "image_size") // square_size(vision_config.patch_size, "patch_size")


def tokens_per_tile(hf_config: Any) -> int:
    return (_patches_per_side(hf_config.vision_config) // shuffle_factor(hf_config)) ** 2


def pixel_shuffle(features: torch.Tensor, k: int) -> torch.Tensor:
    """[N, p, p, D] -> [N, (p/k)^2, k*k*D]: token (r, c) (row-major) holds patches (k r + i, k c + j),
    channels ordered (i, j, D)."""
    n, p, _, dim = features.shape
    blocks = features.view(n, p // k, k, p // k, k, dim).permute(0, 1, 3, 2, 4, 5)  # [N, r, c, i, j, D]
    return blocks.reshape(n, (p // k) ** 2, k * k * dim)


def decoder_config(hf_config: Any) -> Any:
    """A copy of the text config with the top-level ``tie_word_embeddings`` (what transformers ties by)."""
    text = copy.deepcopy(hf_config.text_config)
    text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
    return text


class InternVLMultiModalProjector(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelContext, k: int) -> None:
        super().__init__()
        in_features, hidden = hf_config.vision_config.hidden_size * k * k, hf_config.text_config.hidden_size
        self.layer_norm = nn.LayerNorm(in_features, eps=PROJECTOR_EPS, dtype=ctx.dtype)
        self.linear_1 = vision_linear(in_features, hidden, ctx)
        self.act = get_activation(getattr(hf_config, "projector_hidden_act", "gelu"), "projector_hidden_act")
        self.linear_2 = vision_linear(hidden, hidden, ctx)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(features))))


class InternVLForConditionalGeneration(VisionLanguageModel):
    """The model-module protocol of ``LlamaForCausalLM`` plus, for the model runner's multimodal path:

    supports_multimodal -> True (class attribute)
    IMAGE_PROCESSOR_DEFAULTS -> settings over the checkpoint's image processor config (class attribute)
    image_token_id(hf_config) -> int                                         (class methods: config, tokenizer
    image_token_wrappers(hf_config, tokenizer) -> ([<img> id], [</img> id])   and tensors only, no weights)
    split_image_inputs(hf_config, processed, num_images) -> per image ``pixel_values`` [tiles_i, 3, S, S]
    num_image_tokens(hf_config, image_inputs) -> tiles_i * tokens per tile
    embed_input_ids(input_ids [T]) -> [T, H]
    embed_multimodal(items) -> [num_image_tokens_i, H] per item (first pipeline stage)
    embed_images(pixel_values [N, 3, S, S]) -> [N, tokens per tile, H] (per tile)
    """

    CHECKPOINT_RENAMES = _RENAMES
    IMAGE_PROCESSOR_DEFAULTS = {"crop_to_patches": True}  # InternVLProcessor's own default: tile every image
    # our names of the first stage's non-decoder tensors
    VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")

    def __init__(self, hf_config: Any, ctx: ModelContext) -> None:
        super().__init__()
        self.config = hf_config
        text_type = getattr(hf_config.text_config, "model_type", None)
        if text_type not in TEXT_MODEL_TYPES:
            raise ValueError(f"InternVL with a {text_type!r} language model is not supported; its text_config "
                             f"model_type must be one of {', '.join(TEXT_MODEL_TYPES)}")
        vision_type = getattr(hf_config.vision_config, "model_type", None)
        if vision_type not in VISION_MODEL_TYPES:
            raise ValueError(f"InternVL with a {vision_type!r} vision tower is not supported; its vision_config "
                             f"model_type must be one of {', '.join(VISION_MODEL_TYPES)}")
        _check_strategy(hf_config)
        self.shuffle = shuffle_factor(hf_config)
        self.language_model = LlamaForCausalLM(decoder_config(hf_config), ctx)
        if get_pp_state().is_first:
            self.vision_tower = InternVisionModel(hf_config.vision_config, ctx, feature_layer(hf_config))
            self.multi_modal_projector = InternVLMultiModalProjector(hf_config, ctx, self.shuffle)
        else:
            self.vision_tower = PPMissingLayer()
            self.multi_modal_projector = PPMissingLayer()

    # -- multimodal inputs (class methods: the processor side calls them without a model) -----
    @classmethod
    def image_token_wrappers(cls, hf_config: Any, tokenizer: Any) -> tuple[list[int], list[int]]:
        """The ids put before and after each image's run of placeholders: ``<img>`` and ``</img>`` (the
        tokenizer's ``start_image_token`` / ``end_image_token``, as ``InternVLProcessor`` reads them)."""
        if tokenizer is None:
            raise ValueError("InternVL needs the checkpoint's tokenizer to wrap each image in <img> ... </img>")
        ids = []
        for attr, default in (("start_image_token", "<img>"), ("end_image_token", "</img>")):
            token = getattr(tokenizer, attr, None) or default
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is None or token_id == getattr(tokenizer, "unk_token_id", None):
                raise ValueError(f"the tokenizer has no {token!r} token ({attr}); InternVL wraps each image's "
                                 "placeholders in <img> ... </img>: use the checkpoint's own tokenizer")
            ids.append([int(token_id)])
        return ids[0], ids[1]

    @classmethod
    def split_image_inputs(cls, hf_config: Any, processed: Mapping[str, torch.Tensor],
                           num_images: int) -> list[dict[str, torch.Tensor]]:
        """The image processor's ``pixel_values`` [sum of tiles, 3, S, S] and ``num_patches`` [num_images]
        (tiles per image) -> each image's ``pixel_values`` [tiles_i, 3, S, S]."""
        pixel_values, num_patches = processed.get("pixel_values"), processed.get("num_patches")
        if pixel_values is None or num_patches is None:
            raise ValueError(f"the image processor's output has {sorted(processed)}; {cls.__name__} needs "
                             "pixel_values and num_patches (a GotOcr2 image processor's)")
        sizes = [int(n) for n in torch.as_tensor(num_patches).reshape(-1)]
        if len(sizes) != num_images or min(sizes, default=1) < 1:
            raise ValueError(f"num_patches {sizes} does not give a positive tile count for each of {num_images} images")
        if pixel_values.dim() != 4 or pixel_values.shape[0] != sum(sizes):
            raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}, expected ({sum(sizes)}, 3, S, S) "
                             f"for tiles {sizes}")
        return [{"pixel_values": pixels} for pixels in pixel_values.split(sizes)]

    @classmethod
    def num_image_tokens(cls, hf_config: Any, image_inputs: Mapping[str, torch.Tensor] | None = None) -> int:
        """Placeholder tokens of one image: its tiles times (p / k)^2."""
        return _num_tiles(image_inputs) * tokens_per_tile(hf_config)

    # -- model -----------------------------------------------------------------------------
    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles [N, 3, S, S] (the image processor's) -> their rows [N, (p/k)^2, H] (first pipeline stage)."""
        states = self.vision_tower(pixel_values)[:, 1:]  # [N, p * p, D]: the CLS token dropped
        n, num_patches, dim = states.shape
        side = _patches_per_side(self.config.vision_config)
        assert num_patches == side * side, (num_patches, side)
        return self.multi_modal_projector(pixel_shuffle(states.reshape(n, side, side, dim), self.shuffle))

    def embed_multimodal(self, items: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        """``split_image_inputs`` items -> the rows [num_image_tokens_i, H] that replace each image's
        placeholders (first pipeline stage). Every tile of every item goes through the tower in one call."""
        if not items:
            return []
        tiles = [_num_tiles(item) for item in items]
        device = self.multi_modal_projector.linear_1.weight.device
        pixels = torch.cat([item["pixel_values"] for item in items]).to(device)  # [sum of tiles, 3, S, S]
        features = self.embed_images(pixels)  # [sum of tiles, (p/k)^2, H]
        return [f.reshape(-1, f.shape[-1]) for f in features.split(tiles)]

    def _load_vision_weight(self, name: str, original: str, tensor: torch.Tensor) -> set[str]:
        """Load one ``vision_tower.*`` / ``multi_modal_projector.*`` tensor (``original``: its checkpoint
        name); the names of the parameters it loaded (none for a tensor skipped: a layer not built)."""
        if name.startswith("vision_tower."):
            relative = name.removeprefix("vision_tower.")
            names = self.vision_tower.load_weights([(relative, tensor)], original.removesuffix(relative))
            return {f"vision_tower.{n}" for n in names}
        return self._load_parameter(self.multi_modal_projector, "multi_modal_projector", name, original, tensor)


def _check_strategy(hf_config: Any) -> None:
    """Only "default" (the CLS token dropped): pixel shuffle needs a square patch map (transformers fails too)."""
    strategy = getattr(hf_config, "vision_feature_select_strategy", "default")
    if strategy != "default":
        raise ValueError(f"InternVL with vision_feature_select_strategy {strategy!r} is not supported (pixel shuffle "
                         "needs the square patch map, without the CLS token); use 'default'")


def _num_tiles(image_inputs: Mapping[str, torch.Tensor] | None) -> int:
    pixels = None if image_inputs is None else image_inputs.get("pixel_values")
    if pixels is None or pixels.dim() != 4 or pixels.shape[0] < 1:
        shape = None if pixels is None else tuple(pixels.shape)
        raise ValueError(f"InternVL image inputs need pixel_values [tiles, 3, S, S] (split_image_inputs'), got {shape}")
    return int(pixels.shape[0])
