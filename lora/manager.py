"""The worker side of LoRA: wraps the model's linear layers, loads adapters, and maps each
step's tokens to their adapters.

    add(lora)          read + validate + shard for this rank, keep it (host memory)
    set_batch(...)     once per step: activate the step's adapters (at most max_loras on the
                       device, LRU), tell every wrapped layer which tokens use which adapter
    remove(lora_id)    forget it (an unload, or the core's max_cpu_loras eviction)
    lora_requests()    the loaded adapters' requests (to load them again into a new model)

A step's adapters always fit: the scheduler admits at most ``max_loras`` distinct adapters
among running requests. Adapters are loaded and dropped only when the engine core says
(``halserve.lora.registry``), never during a step: a step reads nothing from disk.

An adapter names modules as the model's HF checkpoint does; the model says how those names
map onto its layers (each part: our module suffix and the fused layer's shard id)::

    STACKED_PARAMS            (".q_proj", ".qkv_proj", "q")      checkpoint q_proj -> our qkv_proj, shard q
    fused_checkpoint_modules  {".qkv_proj": [(".q_proj", Hq),    the checkpoint's own module is fused
                                             (".k_proj", Hk),    (Phi-3): lora_B [(Hq + 2Hk) D, r] is cut
                                             (".v_proj", Hk)]}   into q | k | v rows, each with the same A

The parts of a fused checkpoint module are not names an adapter may use (a Phi-3 adapter never
has q_proj). Mixture-of-experts experts (``FusedMoE``) and their routers are not adaptable: an
adapter that touches them is refused, never served without those weights.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from halserve.layers.fused_moe import FusedMoE
from halserve.layers.linear import LinearBase
from halserve.lora.layers import BaseLinearWithLoRA, LoRABatch, LoRAPair, wrap_linear
from halserve.lora.peft import (
    PeftLoRAConfig,
    adapter_error,
    read_lora_weights,
    read_peft_config,
    resolve_adapter_dir,
)
from halserve.models.pipeline import is_other_stage_weight

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


# one part of a checkpoint module: (its checkpoint name suffix, our module suffix, shard id or None)
RoutePart = tuple[str, str, Any]


def _replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)


def _checkpoint_routes(model: nn.Module) -> dict[str, list[RoutePart]]:
    """Checkpoint module suffix -> its parts in row order, for the names that are not our layers' own."""
    stacked = {hf: (ours, shard_id) for hf, ours, shard_id in getattr(model, "STACKED_PARAMS", [])}
    fused: dict[str, list[tuple[str, int]]] = getattr(model, "fused_checkpoint_modules", {})
    routes = {name: [(part, *stacked.get(part, (part, None))) for part, _ in parts] for name, parts in fused.items()}
    parts_of_fused = {part for parts in fused.values() for part, _ in parts}
    routes.update({hf: [(hf, ours, shard_id)] for hf, (ours, shard_id) in stacked.items() if hf not in parts_of_fused})
    return routes


def _moe_routers(model: nn.Module) -> set[str]:
    """Our names of mixture-of-experts routers: a linear layer beside a FusedMoE with one output
    per expert (Qwen2-MoE's shared_expert_gate, one output, is an ordinary adaptable layer)."""
    routers = set()
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            parent_name = name.rpartition(".")[0]
            for child_name, child in model.get_submodule(parent_name).named_children():
                if isinstance(child, LinearBase) and child.output_size == module.num_experts:
                    routers.add(f"{parent_name}.{child_name}" if parent_name else child_name)
    return routers


class LoRAManager:
    def __init__(self, model: nn.Module, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.model_name = type(model).__name__
        self.device, self.dtype = device, dtype
        self.max_loras = config.max_loras
        self.max_lora_rank = config.max_lora_rank
        self.batch = LoRABatch()
        self.has_moe = any(isinstance(m, FusedMoE) for m in model.modules())
        # Routers stay unwrapped and adapters of them are refused: one that adapts a router usually adapts
        # the experts too (PEFT's all-linear on per-expert checkpoints), which FusedMoE cannot serve, and
        # its router term alone would send tokens to experts without their adapted weights.
        routers = _moe_routers(model)
        self.router_leaves = {name.rsplit(".", 1)[-1] for name in routers}  # "gate"
        # the checkpoint's per-expert projection names (Mixtral's w1/w2/w3), for target_modules checks
        self.expert_leaves = set(getattr(model, "EXPERT_PROJ_NAMES", {})) | {"experts"}
        self.layers: dict[str, BaseLinearWithLoRA] = {}  # our module name -> its wrapper
        for name, module in list(model.named_modules()):
            # (a vision tower's layers, no_lora, see image tokens, not the step's: never adapted)
            skip = name in routers or getattr(module, "no_lora", False)
            wrapper = None if skip else wrap_linear(module, self.batch)
            if wrapper is not None:
                _replace_module(model, name, wrapper)
                self.layers[name] = wrapper
        self.routes = _checkpoint_routes(model)
        self.targetable = self._targetable_names()
        self.model = model
        self._cpu: OrderedDict[int, tuple[LoRARequest, dict[str, LoRAPair]]] = OrderedDict()
        self._active: OrderedDict[int, LoRARequest] = OrderedDict()  # on the device

    def _resolve(self, module: str) -> list[tuple[str, str, Any]] | None:
        """(part name, our layer name, shard id) for each part of checkpoint module ``module``, in
        lora_B row order; None when the model has no LoRA-able layer for it."""
        suffix = max((s for s in self.routes if module.endswith(s)), key=len, default=None)
        if suffix is None:
            targets = [(module, module, None)]
        else:
            stem = module[: -len(suffix)]
            targets = [(stem + part, stem + ours, shard_id) for part, ours, shard_id in self.routes[suffix]]
        for _, layer_name, shard_id in targets:
            layer = self.layers.get(layer_name)
            if layer is None or shard_id not in layer.shard_ids():
                return None
        return targets

    def _targetable_names(self) -> set[str]:
        """Checkpoint module names (last component) an adapter may target: q_proj, ..., down_proj
        (Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj)."""
        names = set()
        for name in self.layers:
            stem, _, leaf = name.rpartition(".")
            leaf = "." + leaf
            candidates = [s for s, parts in self.routes.items() if any(ours == leaf for _, ours, _ in parts)]
            names.update(c.lstrip(".") for c in candidates or [leaf] if self._resolve(stem + c) is not None)
        return names

    def _adaptable_list(self) -> str:
        listed = ", ".join(sorted(self.targetable))
        return f"{listed}; not MoE experts or routers" if self.has_moe else listed

    def _moe_refusal(self, what: str, leaf: str, is_expert: bool) -> str | None:
        """Why ``what`` (a module or a target_modules entry) cannot be adapted, when it is part of a
        mixture-of-experts layer; None otherwise."""
        if not self.has_moe:
            return None
        if is_expert:
            kind = "an expert of a mixture-of-experts layer; LoRA on MoE experts is not supported"
        elif leaf in self.router_leaves:
            kind = "the router of a mixture-of-experts layer; LoRA on MoE routers is not supported"
        else:
            return None
        return (f"{what} is {kind} in halserve ({self.model_name} can adapt: {', '.join(sorted(self.targetable))}); "
                "use an adapter trained with only those modules in target_modules")

    # -- adapters --------------------------------------------------------------------
    def add(self, lora: LoRARequest) -> None:
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

    def lora_requests(self) -> list[LoRARequest]:
        """The requests of the adapters loaded here, in the order they were added: what to ``add`` to
        another manager to load the same adapters (the worker's sleep mode, after a reload of the model)."""
        return [lora for lora, _ in self._cpu.values()]

    def _load(self, lora: LoRARequest) -> dict[str, LoRAPair]:
        adapter_dir = resolve_adapter_dir(lora)
        config = read_peft_config(lora, adapter_dir, self.max_lora_rank)
        self._check_target_modules(lora, config)
        grouped: dict[str, dict[Any, tuple[str, torch.Tensor, torch.Tensor]]] = {}
        # (a vision-language model nests its decoder: the adapter's names for it -> ours)
        rename = getattr(self.model, "map_checkpoint_name", None) or (lambda name: name)
        for module, pair in read_lora_weights(lora, adapter_dir).items():
            module = rename(module)
            if is_other_stage_weight(f"{module}.weight", self.model):
                continue  # (pipeline parallelism: another stage's layer)
            a, b = pair["A"], pair["B"]
            if a.shape[0] != config.r or b.shape[1] != config.r:
                raise adapter_error(lora, f"module {module!r}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} "
                                          f"do not have rank r={config.r} of adapter_config.json")
            for layer_name, shard_id, b_rows in self._split(lora, module, a, b):
                grouped.setdefault(layer_name, {})[shard_id] = (module, a, b_rows)
        return {name: self.layers[name].prepare(lora, modules, config.scaling, self.dtype)
                for name, modules in grouped.items()}

    def _split(self, lora: LoRARequest, module: str, a: torch.Tensor,
               b: torch.Tensor) -> list[tuple[str, Any, torch.Tensor]]:
        """(our layer name, shard id, its rows of lora_B) for each part of checkpoint module ``module``;
        every part keeps the whole lora_A, since x A^T is the same for all of them. ValueError if the
        model lacks the module, or it is an MoE expert or router."""
        targets = self._resolve(module)
        if targets is None:
            leaf = module.rsplit(".", 1)[-1]
            why = self._moe_refusal(f"module {module!r}", leaf, is_expert="experts" in module.split("."))
            raise adapter_error(lora, why or (
                f"it adapts module {module!r}, which {self.model_name} does not have as a LoRA-able layer "
                f"(LoRA can adapt: {self._adaptable_list()}); use an adapter trained for this base model"))
        if len(targets) == 1:
            _, layer_name, shard_id = targets[0]
            return [(layer_name, shard_id, b)]
        sizes = [self.layers[layer_name].full_sizes(shard_id) for _, layer_name, shard_id in targets]
        num_in, rows = sizes[0][0], [num_out for _, num_out in sizes]
        if a.shape[1] != num_in or b.shape[0] != sum(rows):
            parts = " | ".join(f"{part.rsplit('.', 1)[-1]} {n}" for (part, _, _), n in zip(targets, rows))
            raise adapter_error(
                lora, f"module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                f"model's fused layer of {num_in} inputs and {sum(rows)} outputs ({parts}; expected "
                f"({a.shape[0]}, {num_in}) and ({sum(rows)}, {a.shape[0]})); the adapter was trained for a "
                "different base model")
        return [(layer_name, shard_id, b_rows) for (_, layer_name, shard_id), b_rows in zip(targets, b.split(rows))]

    def _check_target_modules(self, lora: LoRARequest, config: PeftLoRAConfig) -> None:
        targets = config.target_modules
        if not isinstance(targets, (list, tuple)):
            return  # a regex or "all-linear": the weights themselves are checked module by module
        for target in targets:
            leaf = str(target).rsplit(".", 1)[-1]
            if leaf in self.targetable:
                continue
            why = self._moe_refusal(f"target module {target!r}", leaf, is_expert=leaf in self.expert_leaves)
            raise adapter_error(lora, why or (
                f"target module {target!r} is not a layer of {self.model_name} that LoRA can adapt here "
                f"(it can: {self._adaptable_list()}; lm_head and embeddings are not supported); "
                "use an adapter trained for this base model on those modules"))

    # -- per step --------------------------------------------------------------------
    def set_batch(self, lora_requests: Sequence[LoRARequest | None], query_start_loc: torch.Tensor) -> None:
        """Map this step's tokens to adapters. ``lora_requests[r]``: request r's adapter (batch
        order); its tokens are ``query_start_loc[r] : query_start_loc[r + 1]``."""
        rows: dict[int, list[int]] = {}
        loras: dict[int, LoRARequest] = {}
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

    def _activate(self, lora: LoRARequest) -> None:
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
