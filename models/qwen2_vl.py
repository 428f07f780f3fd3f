"""Qwen2-VL and Qwen2.5-VL: a vision tower with a patch merger (``qwen2_vl_vision.py``) in front of a
Qwen2 decoder with multimodal rope (M-RoPE, ``layers/rotary.py``).

    image (any size; the image processor resizes it to multiples of p * m pixels)
      pixel_values [t * h * w, C * Tp * p * p], image_grid_thw [3] = (t, h, w) patches  (split_image_inputs)
      vision tower + merger                   [t * h * w / m^2, H]: one row per placeholder token
                                                                     (num_image_tokens, embed_multimodal)

The prompt holds a run of ``num_image_tokens`` ``<|image_pad|>`` tokens per image (between
``<|vision_start|>`` and ``<|vision_end|>``); the caller embeds the text (``embed_input_ids``), puts each
image's rows at its placeholders and runs the decoder on those embeddings with M-RoPE positions
[3, T] (``mrope_positions``): a text token has t = h = w = the previous position + 1; an image's tokens
(temporal i, row r, column c of its merged grid) get (s + i, s + r, s + c) from the position s after
the text before it, and the text after it resumes at s + max(h, w) / m. So positions run behind token
indices; every token after the prompt (generated ones) is at index + delta on all three axes, and a
decode step can pass plain [T] positions.

The vision tower is replicated on every tensor-parallel rank; under pipeline parallelism only the
first stage holds it.

Checkpoint names, both schemes loaded:

    the Hub, transformers' save         newer
    model.embed_tokens, model.layers.*, model.language_model.*
      model.norm
    lm_head.*                           lm_head.*
    visual.*                            model.visual.*

Tied embeddings (Qwen2-VL-2B): ``tie_word_embeddings`` is the top-level config's (transformers 5 keeps
it there); the decoder gets it on a copy of the text config.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from halserve.distributed import get_pp_state
from halserve.layers import ModelContext
from halserve.models.llama import LlamaForCausalLM
from halserve.models.pipeline import PPMissingLayer
from halserve.models.qwen2_vl_vision import Qwen2_5VisionTransformer, Qwen2VisionTransformer
from halserve.models.vision_language import VisionLanguageModel

DEFAULT_MROPE_SECTION = [16, 24, 24]  # transformers' default when a config names none

# newer checkpoint name prefix -> ours (the Hub's column above, the decoder under language_model.)
_RENAMES = [
    ("model.language_model.", "language_model.model."),
    ("model.visual.", "visual."),
    ("model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
]


def decoder_config(hf_config: Any) -> Any:
    """A copy of the text config with what the decoder reads from elsewhere: the top-level
    ``tie_word_embeddings`` and transformers' default ``mrope_section`` when the config names none."""
    text = copy.deepcopy(hf_config.text_config)
    text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False)
                                    or getattr(text, "tie_word_embeddings", False))
    params = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    if params.get("mrope_section") is None:
        params["mrope_section"] = list(DEFAULT_MROPE_SECTION)
        text.rope_parameters = params
    return text


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    """The model-module protocol of ``LlamaForCausalLM`` plus, for the model runner's multimodal path:

    supports_multimodal, uses_mrope -> True (class attributes)
    image_token_id(hf_config) -> int                                       (class methods: config and
    split_image_inputs(hf_config, processed, num_images) -> per-image dicts  tensors only, no weights)
    num_image_tokens(hf_config, image_inputs) -> int
    mrope_positions(hf_config, token_ids, image_inputs) -> (positions [3, T] int64, delta)
    embed_input_ids(input_ids [T]) -> [T, H]
    embed_multimodal(items) -> one [num_image_tokens_i, H] tensor per item (first pipeline stage)
    forward(input_ids [T], positions [T] or [3, T], intermediate_tensors=None, inputs_embeds=None)
    """

    uses_mrope = True
    CHECKPOINT_RENAMES = _RENAMES
    VISION_PREFIXES = ("visual.",)
    VISION_MODEL_TYPE = "qwen2_vl_vision"
    vision_tower_cls: type[Qwen2VisionTransformer] = Qwen2VisionTransformer

    def __init__(self, hf_config: Any, ctx: ModelContext) -> None:
        super().__init__()
        self.config = hf_config
        vision_type = getattr(hf_config.vision_config, "model_type", None)
        if vision_type != self.VISION_MODEL_TYPE:
            raise ValueError(f"{type(self).__name__} needs a {self.VISION_MODEL_TYPE!r} vision_config, got "
                             f"{vision_type!r}; is the checkpoint's architecture the right Qwen-VL version?")
        self.language_model = LlamaForCausalLM(decoder_config(hf_config), ctx)
        if get_pp_state().is_first:
            self.visual = self.vision_tower_cls(hf_config.vision_config, ctx)
        else:
            self.visual = PPMissingLayer()

    # -- multimodal inputs (class methods: the processor side calls them without a model) -----
    @classmethod
    def split_image_inputs(cls, hf_config: Any, processed: Mapping[str, torch.Tensor],
                           num_images: int) -> list[dict[str, torch.Tensor]]:
        """The image processor's batched output (``pixel_values`` [sum of patches, C * Tp * p * p],
        ``image_grid_thw`` [num_images, 3]) -> each image's ``pixel_values`` and ``image_grid_thw`` [3]."""
        pixel_values, grid_thw = processed.get("pixel_values"), processed.get("image_grid_thw")
        if pixel_values is None or grid_thw is None:
            raise ValueError(f"the image processor's output has {sorted(processed)}; {cls.__name__} needs "
                             "pixel_values and image_grid_thw (a Qwen2-VL image processor's)")
        if tuple(grid_thw.shape) != (num_images, 3):
            raise ValueError(f"image_grid_thw has shape {tuple(grid_thw.shape)}, expected ({num_images}, 3) "
                             f"for {num_images} images")
        sizes = [int(n) for n in grid_thw.prod(-1)]
        if sum(sizes) != pixel_values.shape[0]:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, image_grid_thw {grid_thw.tolist()} "
                             f"says {sum(sizes)}")
        return [{"pixel_values": pixels, "image_grid_thw": grid}
                for pixels, grid in zip(pixel_values.split(sizes), grid_thw)]

    @classmethod
    def num_image_tokens(cls, hf_config: Any, image_inputs: Mapping[str, torch.Tensor]) -> int:
        """Placeholder tokens of one image: its patches over the m x m merge (t * h * w / m^2)."""
        t, h, w = _grid(image_inputs)
        merge = hf_config.vision_config.spatial_merge_size
        if h % merge or w % merge:
            raise ValueError(f"image_grid_thw {[t, h, w]} is not a multiple of spatial_merge_size {merge}")
        return t * h * w // (merge * merge)

    @classmethod
    def mrope_positions(cls, hf_config: Any, token_ids: list[int],
                        image_inputs: list[Mapping[str, torch.Tensor]]) -> tuple[torch.Tensor, int]:
        """M-RoPE positions [3, len(token_ids)] (int64) of a prompt whose images' placeholders are expanded
        (each image's ``num_image_tokens`` run, in order), and the delta: a later token at index i is at
        i + delta on every axis. transformers' ``get_rope_index`` for images (module docstring)."""
        image_token = cls.image_token_id(hf_config)
        merge = hf_config.vision_config.spatial_merge_size
        ids = torch.as_tensor(token_ids, dtype=torch.int64)
        num_tokens = ids.numel()
        positions = torch.empty(3, num_tokens, dtype=torch.int64)
        image_starts = (ids == image_token).nonzero().flatten().tolist()
        index, position, next_image = 0, 0, 0  # token index, its position, image_inputs index
        for start in image_starts:
            if start < index:
                continue  # inside the image run just placed
            positions[:, index:start] = torch.arange(position, position + start - index)  # text before it
            position += start - index
            if next_image == len(image_inputs):
                raise ValueError(f"the prompt has more image placeholder runs than its {len(image_inputs)} images")
            t, h, w = _grid(image_inputs[next_image])
            gt, gh, gw = t, h // merge, w // merge
            end = start + gt * gh * gw
            if end > num_tokens or not bool((ids[start:end] == image_token).all()):
                raise ValueError(f"image {next_image} needs {gt * gh * gw} placeholder tokens {image_token} from "
                                 f"index {start}; expand each image's placeholder to num_image_tokens tokens")
            grid = torch.stack(torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij"))
            positions[:, start:end] = grid.reshape(3, -1) + position  # (temporal, row, column) from position
            position += max(h, w) // merge
            index, next_image = end, next_image + 1
        if next_image != len(image_inputs):
            raise ValueError(f"the prompt has placeholders for {next_image} of its {len(image_inputs)} images")
        positions[:, index:] = torch.arange(position, position + num_tokens - index)
        delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
        return positions, delta

    # -- model -----------------------------------------------------------------------------
    def embed_multimodal(self, items: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        """``split_image_inputs`` items -> the rows [num_image_tokens_i, H] that replace each image's
        placeholders (first pipeline stage). All items run through the tower in one call; attention stays
        within each image (and window)."""
        if not items:
            return []
        weight = self.visual.patch_embed.proj.weight
        pixel_values = torch.cat([item["pixel_values"] for item in items]).to(weight.device)
        grid_thw = torch.stack([torch.as_tensor(item["image_grid_thw"]).reshape(3).cpu() for item in items])
        features = self.visual(pixel_values, grid_thw)  # [sum of tokens, H]
        return list(features.split([self.num_image_tokens(self.config, item) for item in items]))

    def _load_vision_weight(self, name: str, original: str, tensor: torch.Tensor) -> set[str]:
        relative = name.removeprefix("visual.")
        return {f"visual.{n}" for n in self.visual.load_weights([(relative, tensor)], original.removesuffix(relative))}


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: Qwen2-VL with a windowed, RMSNorm/SwiGLU vision tower (``qwen2_vl_vision.py``); the
    decoder, M-RoPE positions of images and checkpoint names are Qwen2-VL's."""

    VISION_MODEL_TYPE = "qwen2_5_vl_vision"
    vision_tower_cls = Qwen2_5VisionTransformer


def _grid(image_inputs: Mapping[str, torch.Tensor]) -> list[int]:
    grid = image_inputs.get("image_grid_thw")
    if grid is None or torch.as_tensor(grid).numel() != 3:
        raise ValueError(f"image inputs need image_grid_thw [3] (t, h, w), got {grid!r}")
    return [int(x) for x in torch.as_tensor(grid).reshape(3).tolist()]
