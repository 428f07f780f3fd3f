"""Moving every tensor that holds a model's weights somewhere else (sleep mode's level-1 offload and
its restore: ``Platform.offload_weights`` / ``restore_weights``).

A model's weights are not only its parameters and buffers. After loading, quant methods and layers
keep tensors as plain module attributes: compressed-tensors W4A16's repacked ``qweight`` /
``qzeros`` / ``scales`` (the parameters dropped), w8a8's ``w_scale``, fp8_block's ``block_scale``
(a view of its scale parameter), MLA's absorbed ``w_uk`` / ``w_uv``, a kernel's prepared weight
(a tensor, or a dataclass of tensors such as the CPU kernels' packed weights), GGUF's list of
``(kernel, prepared weight, type)`` runs. ``move_weights`` visits all of them:

    module attribute           visited as
    _parameters[name]          param.data replaced (the Parameter object stays: optimizers, ties)
    _buffers[name]             replaced
    any other tensor           replaced (setattr)
    list / dict                its items, in place (the container object stays)
    tuple / dataclass          rebuilt when an item moved (a frozen dataclass through replace)

Storage, not tensors, is what moves: each distinct storage is copied once and every tensor that
viewed it becomes the same view (offset, sizes, strides) of the copy. A scale and a view of it, or
tied weights, so stay one block of memory instead of two after a round trip.

Left where they are: the KV cache (``kv_cache``: not a weight; sleep drops it first), tensors
without plain storage (oneDNN's opaque layouts, meta tensors) and objects that are neither tensors
nor the containers above (a platform whose kernels keep weights in such objects overrides
``offload_weights``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# nn.Module's own bookkeeping (_parameters, _buffers, _modules, hooks, training): not attributes
# a layer set; the parameters and buffers are visited through their dicts
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
NOT_WEIGHTS = frozenset({"kv_cache"})  # attention layers' KV cache: sleep drops it, wake_up reallocates
MAX_DEPTH = 4  # containers inside containers visited (a guard against cycles)

CopyBytes = Callable[[torch.Tensor], torch.Tensor]
"""``copy(data)``: ``data`` is one storage as uint8 ``[nbytes]``; returns its copy where it should live."""


def move_weights(model: nn.Module, copy: CopyBytes) -> int:
    """Re-home every weight tensor of ``model`` (see the module docstring) through ``copy``; returns the
    number of bytes copied (each storage once)."""
    mover = _StorageMover(copy)
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                param.data = mover.moved(param.data)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = mover.moved(buffer)
        for name, value in list(vars(module).items()):
            if name in _MODULE_INTERNALS or name in NOT_WEIGHTS:
                continue
            new = mover.moved_value(value, MAX_DEPTH)
            if new is not value:
                setattr(module, name, new)
    return mover.num_bytes


def weight_storages(model: nn.Module) -> list[torch.Tensor]:
    """One tensor per distinct storage that ``move_weights`` would move (for tests and accounting)."""
    seen: dict[tuple[str, int], torch.Tensor] = {}

    def record(data: torch.Tensor) -> torch.Tensor:
        seen.setdefault((str(data.device), data.data_ptr()), data)
        return data

    move_weights(model, record)  # (a copy that hands back its input: every tensor stays as it is)
    return list(seen.values())


class _StorageMover:
    def __init__(self, copy: CopyBytes) -> None:
        self.copy = copy
        self.copies: dict[tuple[str, int], torch.Tensor] = {}  # (device, storage address) -> its copy
        self.produced: set[tuple[str, int]] = set()  # the copies' own keys: a tensor visited twice stays
        self.num_bytes = 0

    def moved(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            return tensor
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key in self.produced:
            return tensor
        new = self.copies.get(key) if storage.nbytes() else None
        if new is None:
            data = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)  # [nbytes]
            new = self.copy(data)
            self.num_bytes += new.numel()
            if storage.nbytes():  # (empty storages share address 0: each gets its own)
                self.copies[key] = new
                self.produced.add((str(new.device), new.untyped_storage().data_ptr()))
        if new.device == tensor.device and new.untyped_storage().data_ptr() == storage.data_ptr():
            return tensor  # (not copied)
        return torch.empty(0, dtype=tensor.dtype, device=new.device).set_(
            new.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())

    def moved_value(self, value: Any, depth: int) -> Any:
        """``value`` with its tensors moved: the same object when none was (lists and dicts in place)."""
        if isinstance(value, torch.Tensor):
            if isinstance(value, nn.Parameter):  # (a Parameter kept outside _parameters)
                value.data = self.moved(value.data)
                return value
            return self.moved(value)
        if depth == 0 or isinstance(value, nn.Module):  # (submodules are visited by model.modules())
            return value
        if isinstance(value, list):
            for i, item in enumerate(value):
                value[i] = self.moved_value(item, depth - 1)
            return value
        if isinstance(value, dict):
            for k, item in value.items():
                value[k] = self.moved_value(item, depth - 1)
            return value
        if isinstance(value, tuple):
            items = [self.moved_value(item, depth - 1) for item in value]
            if all(new is old for new, old in zip(items, value)):
                return value
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changed = {}
            for f in dataclasses.fields(value):
                if f.init:
                    old = getattr(value, f.name)
                    new = self.moved_value(old, depth - 1)
                    if new is not old:
                        changed[f.name] = new
            return dataclasses.replace(value, **changed) if changed else value
        return value
