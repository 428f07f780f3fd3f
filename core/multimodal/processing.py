"""From a prompt with images to token ids with placeholders and per-image model inputs.

A vision-language model (``supports_multimodal`` on its class; LLaVA) reads each image as a run
of ``num_image_tokens`` placeholder tokens whose embeddings the model runner replaces with the
image's (``worker/mm_embeddings.py``). Here, before the engine core sees the request:

    prompt ids      ... <image> ...              one placeholder per image, in order (the chat
                                                 template writes them; a user may also write
                                                 each run out in full)
    expanded        ... <image> x N ...          N = the model's tokens per image
    features        MultiModalFeature per image: its pixel values, where its run starts
                    (``offset``) and how long it is, and a content hash (``identifier``)

The hash goes into the prefix cache's block hashes of the blocks the image's run overlaps
(``Request.block_hash_extra_keys``), so equal prompts with different images never share K/V,
while a text prefix before the first image still does.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

IMAGE = "image"
MAX_IMAGES_PER_PROMPT = 64


@dataclass(slots=True)
class MultiModalFeature:
    """One image of a request, as the model runner needs it."""

    modality: str  # "image"
    data: dict[str, torch.Tensor]  # the model's inputs for it: {"pixel_values": [3, H, W]}
    offset: int  # index of its first placeholder token in the prompt
    length: int  # its number of placeholder tokens
    identifier: str  # sha256 (hex) of its processed pixels: equal images, equal K/V

    @property
    def end(self) -> int:
        return self.offset + self.length


def overlapping_identifiers(features: list[MultiModalFeature], start: int, end: int) -> tuple[str, ...]:
    """The identifiers of the images whose placeholder runs overlap tokens [start, end)."""
    return tuple(f.identifier for f in features if f.offset < end and f.end > start)


def _as_image_list(value: Any) -> list:
    from PIL import Image

    images = list(value) if isinstance(value, (list, tuple)) else [value]
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise ValueError(f"multi_modal_data['image'][{i}] is a {type(image).__name__}; images must be "
                             "PIL.Image.Image objects (load files with PIL.Image.open, URLs in chat messages)")
    if not images:
        raise ValueError("multi_modal_data['image'] is empty; give at least one image or leave it out")
    if len(images) > MAX_IMAGES_PER_PROMPT:
        raise ValueError(f"a prompt may hold at most {MAX_IMAGES_PER_PROMPT} images, got {len(images)}")
    return images


class MultiModalProcessor:
    """Per engine: expands a prompt's image placeholders and preprocesses its images with the
    checkpoint's own image processor (``AutoImageProcessor``, as vLLM uses the HF processors)."""

    def __init__(self, model_info: Any) -> None:
        self.info = model_info
        self.image_token_id: int = model_info.image_token_id
        self.tokens_per_image: int = model_info.image_num_tokens
        self._image_processor = None

    @property
    def image_processor(self):
        if self._image_processor is None:
            from transformers import AutoImageProcessor

            try:
                self._image_processor = AutoImageProcessor.from_pretrained(self.info.model_path)
            except Exception as exc:  # noqa: BLE001 - a checkpoint without its processor files
                raise ValueError(f"the checkpoint {self.info.model_path!r} has no usable image processor "
                                 f"(preprocessor_config.json or processor_config.json): {exc}") from None
        return self._image_processor

    def process(self, token_ids: list[int], mm_data: Any) -> tuple[list[int], list[MultiModalFeature]]:
        """``(expanded token ids, one feature per image)``; ValueError for anything malformed."""
        if not isinstance(mm_data, dict):
            raise ValueError(f"multi_modal_data must be a dict like {{'image': image}}, got {type(mm_data).__name__}")
        unknown = sorted(set(mm_data) - {IMAGE})
        if unknown:
            raise ValueError(f"multi_modal_data has {unknown}; this model takes only 'image'")
        images = _as_image_list(mm_data.get(IMAGE))
        ids, offsets = self._expand(token_ids, len(images))
        pixel_values = self._pixel_values(images)
        features = []
        for pixels, offset in zip(pixel_values, offsets):
            digest = hashlib.sha256(str((tuple(pixels.shape), str(pixels.dtype))).encode())
            digest.update(pixels.contiguous().view(torch.uint8).numpy().tobytes())
            features.append(MultiModalFeature(IMAGE, {"pixel_values": pixels}, offset, self.tokens_per_image,
                                              digest.hexdigest()))
        return ids, features

    def _pixel_values(self, images: list) -> torch.Tensor:
        try:
            out = self.image_processor(images=[image.convert("RGB") for image in images], return_tensors="pt")
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - PIL / processor errors on odd images are the input's
            raise ValueError(f"an image could not be preprocessed ({type(exc).__name__}: {exc})") from None
        pixels = out["pixel_values"]
        if not isinstance(pixels, torch.Tensor):
            pixels = torch.stack([torch.as_tensor(p) for p in pixels])
        return pixels.to(torch.float32)

    def _expand(self, token_ids: list[int], num_images: int) -> tuple[list[int], list[int]]:
        """Each lone placeholder becomes a run of ``tokens_per_image``; runs already written out in
        full are kept. Returns the ids and each image's run start."""
        tok, n = self.image_token_id, self.tokens_per_image
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
        if total == num_images and all(length == 1 for _, length in runs):
            ids, offsets = [], []
            prev = 0
            for start, _ in runs:
                ids.extend(token_ids[prev:start])
                offsets.append(len(ids))
                ids.extend([tok] * n)
                prev = start + 1
            ids.extend(token_ids[prev:])
            return ids, offsets
        if total == num_images * n and all(length % n == 0 for _, length in runs):
            offsets = [start + k * n for start, length in runs for k in range(length // n)]
            return list(token_ids), offsets
        raise ValueError(
            f"the prompt has {total} image placeholder tokens (id {tok}) for {num_images} image(s); write the "
            f"model's image token once per image (the chat template does this), or {n} times per image"
        )
