"""From a prompt with images to token ids with placeholders and per-image model inputs.

A vision-language model (``supports_multimodal`` on its class: LLaVA, Qwen2-VL) reads each image
as a run of placeholder tokens whose embeddings the model runner replaces with the image's
(``worker/mm_embeddings.py``). Here, before the engine core sees the request:

    prompt ids      ... <image> ...              one placeholder per image, in order (the chat
                                                 template writes them; a user may also write
                                                 each run out in full)
    expanded        ... <image> x N_i ...        N_i = the model's tokens for image i (fixed for
                                                 LLaVA, by image size for Qwen2-VL)
    features        MultiModalFeature per image: its model inputs (the checkpoint's image
                    processor's output, split per image by the model class), where its run
                    starts (``offset``) and how long it is, and a content hash (``identifier``)
    mrope           M-RoPE models (``uses_mrope``): the prompt's [3, P] positions and the delta
                    of the tokens after it (``MRopePositions``)

The model class answers the model-specific questions (class methods, config only):
``image_token_id``, ``split_image_inputs``, ``num_image_tokens`` and ``mrope_positions``; optionally
``IMAGE_PROCESSOR_DEFAULTS`` (settings its processor class applies over the saved image processor
config, under ``mm_processor_kwargs``) and ``image_token_wrappers(hf_config, tokenizer)`` (token ids the
expansion puts before and after each image's run, as InternVL's ``<img>`` ... ``</img>``).

The hash goes into the prefix cache's block hashes of the blocks the image's run overlaps
(``Request.block_hash_extra_keys``), so equal prompts with different images never share K/V,
while a text prefix before the first image still does.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from halserve.models.interfaces import uses_mrope

if TYPE_CHECKING:
    from halserve.models.interfaces import SupportsMultiModal
    from halserve.models.loader import ModelInfo

IMAGE = "image"
MAX_IMAGES_PER_PROMPT = 64


@dataclass(slots=True)
class MRopePositions:
    """M-RoPE positions of a prompt with images: token i < P sits at ``positions[:, i]``, every later
    token (generated) at i + ``delta`` on all three axes."""

    positions: torch.Tensor  # [3, P] int64
    delta: int


@dataclass(slots=True)
class MultiModalFeature:
    """One image of a request, as the model runner needs it."""

    modality: str  # "image"
    data: dict[str, torch.Tensor]  # the model's inputs for it, e.g. {"pixel_values": [3, H, W]} (LLaVA)
    offset: int  # index of its first placeholder token in the prompt
    length: int  # its number of placeholder tokens
    identifier: str  # sha256 (hex) of its processed pixels: equal images, equal K/V

    @property
    def end(self) -> int:
        return self.offset + self.length


def overlapping_identifiers(features: list[MultiModalFeature], start: int, end: int) -> tuple[str, ...]:
    """The identifiers of the images whose placeholder runs overlap tokens [start, end)."""
    return tuple(f.identifier for f in features if f.offset < end and f.end > start)


def _as_image_list(value: Any, limit: int) -> list:
    from PIL import Image

    images = list(value) if isinstance(value, (list, tuple)) else [value]
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise ValueError(f"multi_modal_data['image'][{i}] is a {type(image).__name__}; images must be "
                             "PIL.Image.Image objects (load files with PIL.Image.open, URLs in chat messages)")
    if not images:
        raise ValueError("multi_modal_data['image'] is empty; give at least one image or leave it out")
    if len(images) > limit:
        raise ValueError(too_many_images(len(images), limit))
    return images


def too_many_images(count: int, limit: int) -> str:
    if limit == 0:
        return ("this server takes no images (limit_mm_per_prompt / --limit-mm-per-prompt sets the image "
                "limit to 0); send text only")
    return (f"a prompt may hold at most {limit} images (limit_mm_per_prompt / --limit-mm-per-prompt), "
            f"got {count}; send fewer")


class MultiModalProcessor:
    """Per engine: expands a prompt's image placeholders and preprocesses its images with the
    checkpoint's own image processor (``AutoImageProcessor``, as vLLM uses the HF processors)."""

    def __init__(self, model_info: ModelInfo, model_cls: type[SupportsMultiModal] | None = None, tokenizer: Any = None) -> None:
        self.info = model_info
        self.tokenizer = tokenizer  # (for the model's image_token_wrappers; None: a model without them)
        self.image_token_id: int = model_info.image_token_id
        if model_cls is None:
            from halserve.models import architecture_class

            model_cls = architecture_class(model_info.architecture)
        self.model_cls: type[SupportsMultiModal] = model_cls
        self._image_processor = None
        self._wrappers: tuple[list[int], list[int]] | None = None

    @property
    def image_processor(self):
        """The checkpoint's image processor, with ``mm_processor_kwargs`` applied (ValueError when they
        change none of its settings: a misspelt or foreign key)."""
        if self._image_processor is None:
            kwargs = getattr(self.info, "image_processor_kwargs", None) or {}
            processor = self._load_image_processor(kwargs)
            if kwargs and processor.to_dict() == self._load_image_processor({}).to_dict():
                settings = ", ".join(sorted(processor.to_dict()))
                raise ValueError(f"mm_processor_kwargs {kwargs} change nothing in the checkpoint's "
                                 f"{type(processor).__name__}; its settings are: {settings}")
            self._image_processor = processor
        return self._image_processor

    def _load_image_processor(self, kwargs: dict[str, Any]):
        from transformers import AutoImageProcessor

        try:
            defaults = getattr(self.model_cls, "IMAGE_PROCESSOR_DEFAULTS", None) or {}
            return AutoImageProcessor.from_pretrained(self.info.model_path, **{**defaults, **kwargs})
        except Exception as exc:  # noqa: BLE001 - a checkpoint without its processor files, a bad kwarg value
            raise ValueError(f"the image processor of {self.info.model_path!r} could not be loaded"
                             f"{' with mm_processor_kwargs ' + str(kwargs) if kwargs else ''} (its "
                             f"preprocessor_config.json or processor_config.json): {exc}") from None

    def process(self, token_ids: list[int], mm_data: Any
                ) -> tuple[list[int], list[MultiModalFeature], MRopePositions | None]:
        """``(expanded token ids, one feature per image, M-RoPE positions or None)``; ValueError for
        anything malformed."""
        if not isinstance(mm_data, dict):
            raise ValueError(f"multi_modal_data must be a dict like {{'image': image}}, got {type(mm_data).__name__}")
        unknown = sorted(set(mm_data) - {IMAGE})
        if unknown:
            raise ValueError(f"multi_modal_data has {unknown}; this model takes only 'image'")
        limit = getattr(self.info, "max_images_per_prompt", MAX_IMAGES_PER_PROMPT)
        images = _as_image_list(mm_data.get(IMAGE), limit)
        items = self._image_inputs(images)
        hf_config = self.info.hf_config
        counts = [int(self.model_cls.num_image_tokens(hf_config, item)) for item in items]
        ids, offsets = self._expand(token_ids, counts, *self.wrappers)
        features = [MultiModalFeature(IMAGE, item, offset, count, _content_hash(item))
                    for item, offset, count in zip(items, offsets, counts)]
        mrope = None
        if uses_mrope(self.model_cls):
            positions, delta = self.model_cls.mrope_positions(hf_config, ids, items)
            mrope = MRopePositions(positions.to(torch.int64), int(delta))
        return ids, features, mrope

    @property
    def wrappers(self) -> tuple[list[int], list[int]]:
        """(ids before, ids after) each expanded image run: the model's ``image_token_wrappers``, or none."""
        if self._wrappers is None:
            wrap = getattr(self.model_cls, "image_token_wrappers", None)
            self._wrappers = wrap(self.info.hf_config, self.tokenizer) if wrap is not None else ([], [])
        return self._wrappers

    def _image_inputs(self, images: list) -> list[dict[str, torch.Tensor]]:
        """The checkpoint's image processor on ``images``, split per image by the model class."""
        try:
            out = self.image_processor(images=[image.convert("RGB") for image in images], return_tensors="pt")
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - PIL / processor errors on odd images are the input's
            raise ValueError(f"an image could not be preprocessed ({type(exc).__name__}: {exc})") from None
        processed = {key: torch.as_tensor(value) for key, value in out.items() if value is not None}
        items = self.model_cls.split_image_inputs(self.info.hf_config, processed, len(images))
        for item in items:  # (floating inputs in float32: the runner casts them to the model dtype)
            for key, value in item.items():
                if value.is_floating_point():
                    item[key] = value.to(torch.float32)
        return items

    def _expand(self, token_ids: list[int], counts: list[int], before: Sequence[int] = (),
                after: Sequence[int] = ()) -> tuple[list[int], list[int]]:
        """Each lone placeholder becomes image i's run of ``counts[i]`` tokens, between ``before`` and
        ``after``; runs already written out in full (one image's, or several images' back to back) are kept
        as they are. Returns the ids and each image's run start."""
        tok, num_images = self.image_token_id, len(counts)
        runs: list[tuple[int, int]] = []  # (start, length) of each run of placeholders
        i = 0
        while i < len(token_ids):
            if token_ids[i] == tok:
                j = i
                while j < len(token_ids) and token_ids[j] == tok:
                    j += 1
                runs.append((i, j - i))
                i = j
            else:
                i += 1
        total = sum(length for _, length in runs)
        if total == num_images and all(length == 1 for _, length in runs) and sum(counts) != total:
            ids, offsets = [], []
            prev = 0
            for (start, _), count in zip(runs, counts):
                ids.extend(token_ids[prev:start])
                ids.extend(before)
                offsets.append(len(ids))
                ids.extend([tok] * count)
                ids.extend(after)
                prev = start + 1
            ids.extend(token_ids[prev:])
            return ids, offsets
        offsets, k = [], 0
        for start, length in runs:  # written out: each run holds whole images, in order
            while length > 0 and k < num_images and counts[k] <= length:
                offsets.append(start)
                start, length, k = start + counts[k], length - counts[k], k + 1
            if length:
                break
        if k == num_images and len(offsets) == num_images and total == sum(counts):
            return list(token_ids), offsets
        per_image = f"{counts[0]} times per image" if len(set(counts)) == 1 else f"{counts} times for the images"
        raise ValueError(
            f"the prompt has {total} image placeholder tokens (id {tok}) for {num_images} image(s); write the "
            f"model's image token once per image (the chat template does this), or {per_image}"
        )


def _content_hash(item: dict[str, torch.Tensor]) -> str:
    """sha256 (hex) of an image's model inputs: names, shapes, dtypes and bytes."""
    digest = hashlib.sha256()
    for key in sorted(item):
        value = item[key].contiguous()
        digest.update(str((key, tuple(value.shape), str(value.dtype))).encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()
