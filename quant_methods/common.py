"""Pieces the quantization formats share: which layers a checkpoint left unquantized, parameters
with loader hints, and per-shard scales of fused layers.

Fused layers. halserve fuses ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj`` and
``gate_proj``/``up_proj`` into ``gate_up_proj``; checkpoints (and their ``ignore`` lists) name the
parts. A per-tensor scale is one number per *part*, so a fused layer holds one per shard::

    qkv_proj.weight_scale   [3]   (q's, k's, v's)       loaded by shard_id "q"/"k"/"v"
    gate_up_proj.weight_scale [2]                       loaded by shard_id 0/1

``expand_shard_scales`` turns them into one scale per output row (exact: no requantization).
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from halserve.quant_methods.base import set_weight_attrs

# halserve's fused layer -> the checkpoint's parts, in shard order
FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def checkpoint_names(prefix: str) -> list[str]:
    """The checkpoint's names for the layer halserve calls ``prefix`` (a fused layer: its parts)."""
    head, _, last = prefix.rpartition(".")
    parts = FUSED_PARTS.get(last)
    if parts is None:
        return [prefix]
    return [f"{head}.{part}" if head else part for part in parts]


def name_matches(name: str, pattern: str) -> bool:
    """compressed-tensors / vLLM matching: ``re:<regex>`` (re.match on the whole name), else the
    name itself or a dotted suffix of it (``lm_head``, ``mlp.down_proj``)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def is_layer_listed(prefix: str, patterns: Iterable[str], what: str) -> bool:
    """Whether the layer ``prefix`` is in ``patterns`` (e.g. the checkpoint's ``ignore`` list).

    A fused layer is listed when all its parts are, and not when none is; some but not all is an
    error (its parts would need two formats in one weight)."""
    patterns = list(patterns)
    if not patterns:
        return False
    if any(name_matches(prefix, p) for p in patterns):
        return True
    names = checkpoint_names(prefix)
    listed = [any(name_matches(n, p) for p in patterns) for n in names]
    if all(listed):
        return True
    if any(listed):
        shown = ", ".join(f"{n} ({'listed' if hit else 'not listed'})" for n, hit in zip(names, listed))
        raise ValueError(f"{what}: halserve fuses {shown} into {prefix}, so they must all be listed or none")
    return False


def add_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
              **attrs: Any) -> nn.Parameter:
    """Register an empty frozen parameter with loader hints (``output_dim``, ``input_dim``, ...)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(param, attrs)
    layer.register_parameter(name, param)
    return param


def shard_index(layer: nn.Module, shard_id: Any) -> int:
    """The position of checkpoint part ``shard_id`` in a fused layer (0 for an unfused one)."""
    if shard_id is None:
        return 0
    shards = getattr(layer, "SHARDS", None)
    return shards.index(shard_id) if shards is not None else int(shard_id)


def add_shard_scale(layer: nn.Module, name: str) -> nn.Parameter:
    """A per-tensor value (scale) per checkpoint part: ``[num_parts]`` float32, each part's
    checkpoint scalar loaded into its slot. Parts never loaded stay NaN (caught after loading)."""
    num_parts = len(layer.output_partition_sizes)

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if loaded.numel() != 1:
            raise ValueError(f"{layer.prefix}.{name}: expected one value per tensor, got shape {tuple(loaded.shape)}")
        param.data[shard_index(layer, shard_id)] = loaded.reshape(()).float()

    param = add_param(layer, name, (num_parts,), torch.float32, weight_loader=load)
    param.data.fill_(float("nan"))
    return param


def expand_shard_scales(layer: nn.Module, scales: torch.Tensor) -> torch.Tensor:
    """``[num_parts]`` -> ``[N_local, 1]``: each part's scale repeated over its output rows."""
    if torch.isnan(scales).any():
        raise ValueError(f"{layer.prefix}: the checkpoint has no scale for some of its parts "
                         f"({', '.join(checkpoint_names(layer.prefix))})")
    sizes = torch.tensor(layer.output_partition_sizes, device=scales.device)
    return scales.float().repeat_interleave(sizes).reshape(-1, 1)


def shared_input_scale(layer: nn.Module, scales: torch.Tensor) -> torch.Tensor:
    """One static activation scale for a fused layer: its parts read the same input, so the
    largest of their scales covers all of them (as vLLM does). ``[1]`` float32."""
    if torch.isnan(scales).any():
        raise ValueError(f"{layer.prefix}: the checkpoint has no input_scale for some of its parts")
    return scales.float().amax().reshape(1)


def prepare_gemm_weight(layer: nn.Module) -> None:
    """Let ``layer.gemm_kernel`` repack ``layer.weight`` once, after loading (e.g. oneDNN's blocked layout,
    or the CPU fp8 kernel's tile order); the checkpoint's copy is then dropped so the weight is not held
    twice. ``gemm_weight(layer)`` is what to pass the kernel."""
    data = layer.weight.data  # (``.data`` is a new tensor object at every read: compared once)
    prepared = layer.gemm_kernel.prepare_weight(data)
    if prepared is not data:
        layer.prepared_weight = prepared
        layer.weight.data = torch.empty(0, dtype=layer.weight.dtype, device=layer.weight.device)


def gemm_weight(layer: nn.Module):
    """The weight argument of ``layer.gemm_kernel``: the prepared one, else ``layer.weight``."""
    prepared = getattr(layer, "prepared_weight", None)
    return layer.weight if prepared is None else prepared


def drop_param(layer: nn.Module, name: str) -> None:
    """Free a parameter that only served loading (e.g. a scale folded into another)."""
    if name in layer._parameters:
        del layer._parameters[name]
