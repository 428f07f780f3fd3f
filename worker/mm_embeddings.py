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
of one step go through the encoder together (``embed_multimodal``).

M-RoPE models (Qwen2-VL) place a prompt with images on three position axes (``step_positions``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from halserve.models.interfaces import SupportsMultiModal
    from halserve.worker.runner_state import StepInputs


def step_inputs_embeds(model: SupportsMultiModal, step: StepInputs, input_ids: torch.Tensor) -> torch.Tensor | None:
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
    _encode_missing(model, [(state, k) for *_, state, k in spans])
    embeds = model.embed_input_ids(input_ids)
    for row0, start, end, state, k in spans:
        feature = state.mm_features[k]
        lo, hi = max(start, feature.offset), min(end, feature.end)
        embeds[row0 + lo - start : row0 + hi - start] = state.mm_embeddings[k][lo - feature.offset : hi - feature.offset]
        if end >= feature.end:  # its last placeholder is fed now
            del state.mm_embeddings[k]
    return embeds


def _encode_missing(model: SupportsMultiModal, needed: list) -> None:
    """Run the vision encoder (``embed_multimodal``, all in one call) on the images in ``needed``
    ((state, feature index) pairs) that have no embedding yet. An image (by content hash) that
    another of the step's requests holds already, or that several need (``n`` samples of one
    prompt), is encoded once and shared."""
    known: dict[str, torch.Tensor] = {}
    for state, _ in needed:
        if state.mm_embeddings is None:
            state.mm_embeddings = {}
        for k, rows in state.mm_embeddings.items():
            known[state.mm_features[k].identifier] = rows
    todo: dict[str, list] = {}  # identifier -> the (state, feature index) pairs waiting for it
    for state, k in needed:
        if k in state.mm_embeddings:
            continue
        ident = state.mm_features[k].identifier
        if ident in known:
            state.mm_embeddings[k] = known[ident]
        else:
            todo.setdefault(ident, []).append((state, k))
    if not todo:
        return
    firsts = [pairs[0] for pairs in todo.values()]
    outputs = model.embed_multimodal([state.mm_features[k].data for state, k in firsts])
    for pairs, rows in zip(todo.values(), outputs):
        length = pairs[0][0].mm_features[pairs[0][1]].length
        if rows.shape[0] != length:
            raise RuntimeError(f"the vision encoder gave {rows.shape[0]} embeddings for an image of {length} "
                               "placeholder tokens; the checkpoint's processor and model disagree")
        for state, k in pairs:
            state.mm_embeddings[k] = rows


def step_positions(step: StepInputs) -> torch.Tensor:
    """The step's positions for an M-RoPE model: [3, T] when a request has M-RoPE positions (its
    prompt's, then i + delta), else the plain [T] ones (the model uses them on all three axes)."""
    positions = step.positions
    if not any(state.mrope_positions is not None for state in step.states):
        return positions
    out = positions.unsqueeze(0).repeat(3, 1)
    qsl = step.common.query_start_loc_cpu.tolist()
    for r, state in enumerate(step.states):
        mrope = state.mrope_positions
        if mrope is None:
            continue
        index = positions[qsl[r] : qsl[r + 1]]
        in_prompt = index < mrope.positions.shape[1]
        rows = out[:, qsl[r] : qsl[r + 1]]
        rows[:, in_prompt] = mrope.positions[:, index[in_prompt]]
        rows[:, ~in_prompt] = index[~in_prompt] + mrope.delta
    return out


def model_kwargs(model: SupportsMultiModal, step: StepInputs, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's extra forward arguments for the step on a vision-language model's first stage:
    ``inputs_embeds`` when the step feeds any image's placeholder, else none."""
    embeds = step_inputs_embeds(model, step, input_ids)
    return {} if embeds is None else {"inputs_embeds": embeds}
