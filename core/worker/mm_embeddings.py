"""The input embeddings of a step with images (vision-language models; ``halserve.multimodal``).

A request's image is a run of placeholder tokens in its prompt (``MultiModalFeature``: offset,
length). When a step schedules any of those tokens, the model's vision encoder runs on the whole
image once (``embed_images``: [N, length, H]), and its rows replace the placeholders' text
embeddings in the step's ``inputs_embeds``::

    request r scheduled tokens [start, end)      (chunked prefill may cut an image anywhere)
    image f   placeholders     [offset, offset + length)
    rows      [max(start, offset), min(end, offset + length)) <- embedding[... - offset]

An image's embedding stays on the request's runner state until its last placeholder has been
fed (a later chunk may need the rest), then is dropped; a preempted request recomputes it. Images
of one step go through the encoder together, batched by pixel shape.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from halserve.worker.runner_state import StepInputs


def step_inputs_embeds(model: torch.nn.Module, step: "StepInputs", input_ids: torch.Tensor) -> torch.Tensor | None:
    """``inputs_embeds`` [T, H] for ``input_ids`` (on the device) when the step feeds any image's
    placeholder; None otherwise (the model embeds the token ids itself)."""
    qsl = step.common.query_start_loc_cpu.tolist()
    spans = []  # (batch row of the request's first scheduled token, start, end, state, feature index)
    for r, state in enumerate(step.states):
        if not state.mm_features:
            continue
        end = int(step.seq_lens[r])
        start = end - (qsl[r + 1] - qsl[r])
        for k, feature in enumerate(state.mm_features):
            if feature.offset < end and feature.end > start:
                spans.append((qsl[r], start, end, state, k))
    if not spans:
        return None
    _encode_missing(model, [(state, k) for *_, state, k in spans], input_ids.device)
    embeds = model.embed_input_ids(input_ids)
    for row0, start, end, state, k in spans:
        feature = state.mm_features[k]
        lo, hi = max(start, feature.offset), min(end, feature.end)
        embeds[row0 + lo - start : row0 + hi - start] = state.mm_embeddings[k][lo - feature.offset : hi - feature.offset]
        if end >= feature.end:  # its last placeholder is fed now
            del state.mm_embeddings[k]
    return embeds


def _encode_missing(model: torch.nn.Module, needed: list, device: torch.device) -> None:
    """Run the vision encoder on the images in ``needed`` ((state, feature index) pairs) that have
    no embedding yet, one batch per pixel shape."""
    by_shape: dict[tuple, list] = {}
    for state, k in needed:
        if state.mm_embeddings is None:
            state.mm_embeddings = {}
        if k not in state.mm_embeddings:
            pixels = state.mm_features[k].data["pixel_values"]
            by_shape.setdefault(tuple(pixels.shape), []).append((state, k))
    for group in by_shape.values():
        pixels = torch.stack([s.mm_features[k].data["pixel_values"] for s, k in group]).to(device)
        out = model.embed_images(pixels)  # [N, length, H]
        for i, (state, k) in enumerate(group):
            length = state.mm_features[k].length
            if out.shape[1] != length:
                raise RuntimeError(f"the vision encoder gave {out.shape[1]} embeddings for an image of {length} "
                                   "placeholder tokens; the checkpoint's processor and model disagree")
            state.mm_embeddings[k] = out[i]
