"""What a model needs for pipeline parallelism: which decoder layers this stage holds, a
placeholder for the others, and which checkpoint tensors belong to other stages.

Stage s of S holds layers ``[start, end)`` (``stage_layer_range``); the first stage also
embeds the tokens, the last one applies the final norm and the head. Between stages the
model passes ``IntermediateTensors`` (the hidden states and the residual stream) that the
model runner sends and receives. Layer indices and parameter names stay those of the whole
model (``model.layers.7`` is still called that on stage 1), so checkpoints load unchanged.
"""
from __future__ import annotations

import os
import re

import torch
from torch import nn

from halserve.distributed import get_pp_state

IntermediateTensors = dict[str, torch.Tensor]

PARTITION_ENV = "HALSERVE_PP_LAYER_PARTITION"
"""Layers per stage, comma-separated (``"10,11,11"``), instead of the even split (vLLM's
``VLLM_PP_LAYER_PARTITION``)."""

_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class PPMissingLayer(nn.Identity):
    """Stands in for a layer (or embedding, norm, head) that another pipeline stage holds."""


def layer_partition(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage: ``HALSERVE_PP_LAYER_PARTITION`` if set, else as even as possible with the
    extra layers on the stages before the last (which also runs the head)."""
    text = os.environ.get(PARTITION_ENV)
    if text:
        try:
            sizes = [int(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"{PARTITION_ENV}={text!r}: give the layers per stage as integers, "
                             "e.g. '6,6'") from None
        if len(sizes) != num_stages or sum(sizes) != num_layers or min(sizes) < 1:
            raise ValueError(f"{PARTITION_ENV}={text!r} must give {num_stages} stage sizes >= 1 summing to "
                             f"the model's {num_layers} layers")
        return sizes
    if num_layers < num_stages:
        raise ValueError(f"pipeline_parallel_size {num_stages} is more than the model's {num_layers} layers; "
                         f"use at most {num_layers} stages")
    sizes = [num_layers // num_stages] * num_stages
    for i in range(num_layers % num_stages):
        sizes[-2 - i] += 1
    return sizes


def stage_layer_range(num_layers: int) -> tuple[int, int]:
    """This process's stage's layers, ``[start, end)``."""
    pp = get_pp_state()
    sizes = layer_partition(num_layers, pp.size)
    start = sum(sizes[: pp.rank])
    return start, start + sizes[pp.rank]


def make_layers(num_layers: int, make_layer, prefix: str) -> tuple[int, int, nn.ModuleList]:
    """(start, end, layers): ``make_layer(i, f"{prefix}.layers.{i}")`` for this stage's layers and
    ``PPMissingLayer`` for the rest, so indices and parameter names match the checkpoint's."""
    start, end = stage_layer_range(num_layers)
    layers = nn.ModuleList(make_layer(i, f"{prefix}.layers.{i}") if start <= i < end else PPMissingLayer()
                           for i in range(num_layers))
    return start, end, layers


def is_other_stage_weight(name: str, model: nn.Module) -> bool:
    """Whether checkpoint tensor ``name`` belongs to another pipeline stage: a decoder layer this
    stage does not hold, or a module that is a ``PPMissingLayer`` here."""
    if get_pp_state().size == 1:
        return False
    match = _LAYER_NAME.search(name)
    inner = getattr(model, "model", model)
    start, end = getattr(inner, "start_layer", None), getattr(inner, "end_layer", None)
    if match and start is not None and not start <= int(match.group(1)) < end:
        return True
    module_name = name.rsplit(".", 1)[0]
    while module_name:
        module = _get_submodule(model, module_name)
        if isinstance(module, PPMissingLayer):
            return True
        if module is not None:
            return False
        module_name = module_name.rpartition(".")[0]
    return False


def _get_submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def empty_intermediate_tensors(num_tokens: int, hidden_size: int, dtype: torch.dtype,
                               device: torch.device) -> IntermediateTensors:
    """Buffers for what the decoders of this project pass between stages."""
    return {key: torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
            for key in ("hidden_states", "residual")}
