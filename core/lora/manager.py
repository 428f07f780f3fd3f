"""The worker side of LoRA: wraps the model's linear layers, loads adapters, and maps each
step's tokens to their adapters.

    add(lora)          read + validate + shard for this rank, keep it (host memory)
    set_batch(...)     once per step: activate the step's adapters (at most max_loras on the
                       device, LRU), tell every wrapped layer which tokens use which adapter
    remove(lora_id)    forget it (an unload, or the core's max_cpu_loras eviction)

A step's adapters always fit: the scheduler admits at most ``max_loras`` distinct adapters
among running requests. Adapters are loaded and dropped only when the engine core says
(``halserve.lora.registry``), never during a step: a step reads nothing from disk.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
from torch import nn

from halserve.lora.layers import BaseLinearWithLoRA, LoRABatch, LoRAPair, wrap_linear
from halserve.lora.peft import (
    PeftLoRAConfig,
    adapter_error,
    read_lora_weights,
    read_peft_config,
    resolve_adapter_dir,
)

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


def _replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)


class LoRAManager:
    def __init__(self, model: nn.Module, config: "EngineConfig", device: torch.device, dtype: torch.dtype) -> None:
        self.model_name = type(model).__name__
        self.device, self.dtype = device, dtype
        self.max_loras = config.max_loras
        self.max_lora_rank = config.max_lora_rank
        self.batch = LoRABatch()
        self.layers: dict[str, BaseLinearWithLoRA] = {}  # our module name -> its wrapper
        for name, module in list(model.named_modules()):
            wrapper = wrap_linear(module, self.batch)
            if wrapper is not None:
                _replace_module(model, name, wrapper)
                self.layers[name] = wrapper
        # checkpoint module suffix -> (our fused module suffix, shard id), e.g. .q_proj -> .qkv_proj "q"
        self.stacked: list[tuple[str, str, Any]] = list(getattr(model, "STACKED_PARAMS", []))
        self.targetable = self._targetable_names()
        self._cpu: OrderedDict[int, tuple["LoRARequest", dict[str, LoRAPair]]] = OrderedDict()
        self._active: OrderedDict[int, "LoRARequest"] = OrderedDict()  # on the device

    def _targetable_names(self) -> set[str]:
        """Checkpoint module names (last component) an adapter may target: q_proj, ..., down_proj."""
        names = set()
        for name in self.layers:
            leaf = "." + name.rsplit(".", 1)[-1]
            fused = [hf for hf, ours, _ in self.stacked if ours == leaf]
            names.update(part.lstrip(".") for part in (fused or [leaf]))
        return names

    # -- adapters --------------------------------------------------------------------
    def add(self, lora: "LoRARequest") -> None:
        """Load and validate ``lora`` (ValueError naming the adapter and the fix). The engine
        core decides what stays loaded (``halserve.lora.registry``): nothing is evicted here."""
        if lora.lora_int_id not in self._cpu:
            self._cpu[lora.lora_int_id] = (lora, self._load(lora))

    def remove(self, lora_id: int) -> bool:
        found = self._cpu.pop(lora_id, None) is not None
        if lora_id in self._active:
            self._deactivate(lora_id)
            found = True
        return found

    def list_loras(self) -> list[int]:
        return list(self._cpu)

    def _load(self, lora: "LoRARequest") -> dict[str, LoRAPair]:
        adapter_dir = resolve_adapter_dir(lora)
        config = read_peft_config(lora, adapter_dir, self.max_lora_rank)
        self._check_target_modules(lora, config)
        grouped: dict[str, dict[Any, tuple[str, torch.Tensor, torch.Tensor]]] = {}
        for module, pair in read_lora_weights(lora, adapter_dir).items():
            layer_name, shard_id = self._target(lora, module)
            a, b = pair["A"], pair["B"]
            if a.shape[0] != config.r or b.shape[1] != config.r:
                raise adapter_error(lora, f"module {module!r}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} "
                                          f"do not have rank r={config.r} of adapter_config.json")
            grouped.setdefault(layer_name, {})[shard_id] = (module, a, b)
        return {name: self.layers[name].prepare(lora, modules, config.scaling, self.dtype)
                for name, modules in grouped.items()}

    def _target(self, lora: "LoRARequest", module: str) -> tuple[str, Any]:
        """(our layer name, shard id) of a checkpoint module name; ValueError if the model lacks it."""
        target: tuple[str, Any] = (module, None)
        for hf_part, our_part, shard_id in self.stacked:
            if module.endswith(hf_part):
                target = (module[: -len(hf_part)] + our_part, shard_id)
                break
        layer = self.layers.get(target[0])
        if layer is None or target[1] not in layer.shard_ids():
            raise adapter_error(
                lora, f"it adapts module {module!r}, which {self.model_name} does not have as a LoRA-able layer "
                f"(LoRA can adapt: {', '.join(sorted(self.targetable))}); use an adapter trained for this base model")
        return target

    def _check_target_modules(self, lora: "LoRARequest", config: PeftLoRAConfig) -> None:
        targets = config.target_modules
        if not isinstance(targets, (list, tuple)):
            return  # a regex or "all-linear": the weights themselves are checked module by module
        for target in targets:
            if str(target).rsplit(".", 1)[-1] not in self.targetable:
                raise adapter_error(
                    lora, f"target module {target!r} is not a layer of {self.model_name} that LoRA can adapt here "
                    f"(it can: {', '.join(sorted(self.targetable))}; lm_head and embeddings are not supported); "
                    "use an adapter trained for this base model on those modules")

    # -- per step --------------------------------------------------------------------
    def set_batch(self, lora_requests: Sequence["LoRARequest | None"], query_start_loc: torch.Tensor) -> None:
        """Map this step's tokens to adapters. ``lora_requests[r]``: request r's adapter (batch
        order); its tokens are ``query_start_loc[r] : query_start_loc[r + 1]``."""
        rows: dict[int, list[int]] = {}
        loras: dict[int, "LoRARequest"] = {}
        for r, lora in enumerate(lora_requests):
            if lora is not None:
                rows.setdefault(lora.lora_int_id, []).append(r)
                loras[lora.lora_int_id] = lora
        if not rows:
            self.batch.groups = []
            return
        assert len(rows) <= self.max_loras, f"{len(rows)} adapters in one step, max_loras={self.max_loras}"
        for lora in loras.values():
            self._activate(lora)
        qsl = query_start_loc.numpy()
        groups: list[tuple[int, torch.Tensor | None]] = []
        for lora_id, members in rows.items():
            if len(members) == len(lora_requests):
                groups.append((lora_id, None))  # every token: no gather/scatter
                continue
            index = np.concatenate([np.arange(qsl[r], qsl[r + 1]) for r in members])
            groups.append((lora_id, torch.from_numpy(index).to(self.device, non_blocking=True)))
        self.batch.groups = groups

    def _activate(self, lora: "LoRARequest") -> None:
        lora_id = lora.lora_int_id
        if lora_id in self._active:
            self._active.move_to_end(lora_id)
            return
        assert lora_id in self._cpu, f"LoRA {lora_id} is not loaded (the engine core loads it before its requests)"
        _, weights = self._cpu[lora_id]
        if len(self._active) >= self.max_loras:
            self._deactivate(next(iter(self._active)))  # the least recently used (never one of this step's)
        for name, (a, b) in weights.items():
            self.layers[name].lora_weights[lora_id] = (a.to(self.device), b.to(self.device))
        self._active[lora_id] = lora

    def _deactivate(self, lora_id: int) -> None:
        del self._active[lora_id]
        for layer in self.layers.values():
            layer.lora_weights.pop(lora_id, None)


__all__ = ["LoRAManager"]
