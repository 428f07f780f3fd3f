"""Mixture-of-experts MLP: top-k routing and every expert's SwiGLU weights stacked in two tensors.

    w13_weight  [E, 2 * I/tp, H]   rows [0, I/tp) this rank's gate slice, then its up slice
    w2_weight   [E, H, I/tp]       this rank's down-projection columns

Tensor parallelism splits the intermediate dim of every expert (each rank holds all
experts): like a column-parallel gate/up followed by a row-parallel down, each rank's
output is a partial sum that is all-reduced.

Checkpoints come in two layouts; ``ExpertWeightLoader`` accepts both:

    per expert (the Hub, and transformers' save_pretrained)   {moe}.experts.{e}.{gate|up|down proj}.weight
    fused (save_pretrained(save_original_format=False))       {moe}.experts.gate_up_proj [E, 2I, H]
                                                              {moe}.experts.down_proj    [E, H, I]

Quantized checkpoints (GPTQ, AWQ, fp8, compressed-tensors) store each expert projection in their
format (``...experts.{e}.gate_proj.qweight``, ``.scales``, ...). The experts are held in the model
dtype: the loader gathers a projection's tensors and has the quant method the checkpoint gives
that projection dequantize them (``QuantMethod.dequantize_weight``), then loads the result like a
float one. The other layers stay quantized; the experts take the memory of a float checkpoint's.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from halserve.distributed import divide, get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from halserve.kernels import resolve_kernel
from halserve.layers.context import ModelContext

if TYPE_CHECKING:  # pragma: no cover
    from halserve.quant_methods.base import QuantMethod

SHARD_IDS = ("gate", "up", "down")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, keep the ``top_k`` largest, optionally rescaled to sum to 1.

    router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int64)
    """
    probs = F.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


class FusedMoE(nn.Module):
    """``forward(hidden [T, H], router_logits [T, E]) -> [T, H]``: the routed experts' weighted sum.

    ``reduce_results=False`` leaves this rank's partial sum un-reduced, for a caller that adds
    more partial sums (a shared expert) and reduces once.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 ctx: ModelContext, prefix: str = "", reduce_results: bool = True) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"{prefix}: num_experts_per_tok {top_k} must be between 1 and the number of "
                             f"experts ({num_experts})")
        self.prefix = prefix
        self.ctx = ctx  # (the quant method of each expert projection, for the loader)
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.reduce_results = reduce_results
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.intermediate_size = intermediate_size
        self.intermediate_size_per_partition = divide(intermediate_size, self.tp_size,
                                                      f"{prefix} moe intermediate size")
        local = self.intermediate_size_per_partition
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size, dtype=ctx.dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, local, dtype=ctx.dtype),
                                      requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        self.kernel = resolve_kernel("fused_moe", ctx.platform_name, dtype=ctx.dtype_name, num_experts=num_experts,
                                     top_k=top_k, hidden_size=hidden_size, intermediate_size=local)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None,
                      expert_id: int | None = None) -> None:
        """Copy this rank's slice of a checkpoint tensor into ``param``.

        With ``expert_id``: one expert's ``shard_id`` ("gate"/"up" [I, H], "down" [H, I]).
        Without: the fused tensor of every expert (w13 [E, 2I, H] or w2 [E, H, I]).
        """
        if expert_id is not None and not 0 <= expert_id < self.num_experts:
            raise ValueError(f"{self.prefix}: checkpoint has expert {expert_id}, the config declares "
                             f"num_experts={self.num_experts}")
        local, full = self.intermediate_size_per_partition, self.intermediate_size
        start = self.tp_rank * local
        if param is self.w2_weight:
            if shard_id not in (None, "down"):
                raise ValueError(f"{self.prefix}: w2 takes the down projection, got shard {shard_id!r}")
            if loaded.dim() < 2 or loaded.shape[-1] != full:
                raise ValueError(f"{self.prefix}: checkpoint down tensor has shape {tuple(loaded.shape)}, expected "
                                 f"{full} columns (moe intermediate size)")
            dst = param.data if expert_id is None else param.data[expert_id]
            self._copy(dst, loaded.narrow(-1, start, local), loaded, "down")
            return
        if expert_id is None:  # fused [E, 2I, H]: gate rows then up rows
            self._check_rows(loaded, 2 * full, "gate_up")
            self._copy(param.data[:, :local], loaded[:, start : start + local], loaded, "gate_up")
            self._copy(param.data[:, local:], loaded[:, full + start : full + start + local], loaded, "gate_up")
            return
        if shard_id not in ("gate", "up"):
            raise ValueError(f"{self.prefix}: w13 takes shard 'gate' or 'up', got {shard_id!r}")
        self._check_rows(loaded, full, shard_id)
        offset = 0 if shard_id == "gate" else local
        self._copy(param.data[expert_id, offset : offset + local], loaded[start : start + local], loaded, shard_id)

    def expert_method(self, expert_id: int, proj: str) -> QuantMethod:
        """The quant method the checkpoint gives projection ``proj`` (its own name) of an expert."""
        return self.ctx.linear_method(f"{self.prefix}.{expert_id}.{proj}")

    def _check_rows(self, loaded: torch.Tensor, rows: int, what: str) -> None:
        # a tensor with more rows than the config says would still slice without error, wrongly
        if loaded.dim() < 2 or loaded.shape[-2] != rows:
            raise ValueError(f"{self.prefix}: checkpoint {what} tensor has shape {tuple(loaded.shape)}, expected "
                             f"{rows} rows (moe intermediate size {self.intermediate_size})")

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
        if dst.shape != src.shape:
            raise ValueError(f"{self.prefix}: checkpoint {what} tensor has shape {tuple(loaded.shape)}, which does "
                             f"not fit parameter slice {tuple(dst.shape)} (tp={self.tp_size})")
        dst.copy_(src)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = self.kernel(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids)  # [T, H] partial
        return tensor_model_parallel_all_reduce(out) if self.reduce_results else out

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, intermediate={self.intermediate_size_per_partition}, "
                f"renormalize={self.renormalize}, tp={self.tp_size}")


_PER_EXPERT = re.compile(r"^(?P<moe>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<tensor>\w+)$")
_FUSED = re.compile(r"^(?P<moe>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)$")


class ExpertWeightLoader:
    """Routes a checkpoint's expert tensors into the FusedMoE parameters and passes every
    other tensor through, for a model's ordinary ``load_weights`` to handle.

    ``proj_names`` maps the checkpoint's per-expert projection names to shard ids, e.g.
    Mixtral's ``{"w1": "gate", "w3": "up", "w2": "down"}``.
    """

    def __init__(self, model: nn.Module, proj_names: dict[str, str]) -> None:
        assert set(proj_names.values()) == set(SHARD_IDS), proj_names
        self.params = dict(model.named_parameters())
        self.proj_names = proj_names
        # "model.layers.0.mlp" -> the FusedMoE registered there as ``experts``
        self.modules = {name.removesuffix(".experts"): module
                        for name, module in model.named_modules() if isinstance(module, FusedMoE)}
        self.num_experts = {name: module.num_experts for name, module in self.modules.items()}
        self.seen: dict[str, set[tuple[int, str]]] = {}  # parameter -> (expert, shard) loaded so far
        # (moe, expert, proj) -> the tensors of a quantized projection gathered so far
        self.pending: dict[tuple[str, int, str], dict[str, torch.Tensor]] = {}

    def load_or_pass(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if not self._load(name, tensor):
                yield name, tensor

    def _load(self, name: str, tensor: torch.Tensor) -> bool:
        if match := _PER_EXPERT.match(name):
            shard_id = self.proj_names.get(match["proj"])
            if shard_id is None or match["moe"] not in self.modules:
                return False
            expert_id: int | None = int(match["expert"])
            tensor = self._gather(match["moe"], expert_id, match["proj"], shard_id, match["tensor"], tensor)
            if tensor is None:  # (kept until the projection's other tensors come, or ignored)
                return True
        elif match := _FUSED.match(name):
            shard_id, expert_id = None, None
            module = self.modules.get(match["moe"])
            if module is not None and module.expert_method(0, match["proj"]).expert_weight_names()[0] != ("weight",):
                raise ValueError(f"{name}: fused expert tensors in a quantized checkpoint are not supported (only "
                                 "per-expert tensors: experts.{e}.{projection}.*)")
        else:
            return False
        moe = match["moe"]
        if moe not in self.num_experts:
            return False
        which = "w2_weight" if shard_id == "down" or match["proj"] == "down_proj" else "w13_weight"
        target = f"{moe}.experts.{which}"
        param = self.params[target]
        param.weight_loader(param, tensor, shard_id, expert_id)
        shards = ("down",) if which == "w2_weight" else ("gate", "up")
        experts = range(self.num_experts[moe]) if expert_id is None else (expert_id,)
        self.seen.setdefault(target, set()).update((e, s) for e in experts for s in shards
                                                   if shard_id is None or s == shard_id)
        return True

    def _gather(self, moe: str, expert_id: int, proj: str, shard_id: str, kind: str,
                tensor: torch.Tensor) -> torch.Tensor | None:
        """The float weight of an expert projection once all its checkpoint tensors are in (at once
        for a float checkpoint); None while some are missing, or when ``kind`` is one the format ignores.
        ValueError for a tensor the format does not have."""
        module = self.modules[moe]
        method = module.expert_method(expert_id, proj)
        needed, ignored = method.expert_weight_names()
        if kind in ignored:
            return None
        if kind not in needed:
            raise ValueError(f"{moe}.experts.{expert_id}.{proj}.{kind}: not a tensor of a {method.name} expert "
                             f"projection (expected {', '.join(needed)})")
        key = (moe, expert_id, proj)
        parts = self.pending.setdefault(key, {})
        parts[kind] = tensor
        if len(parts) < len(needed):
            return None
        del self.pending[key]
        hidden, inter = module.w13_weight.shape[-1], module.intermediate_size
        in_size, out_size = (inter, hidden) if shard_id == "down" else (hidden, inter)
        return method.dequantize_weight(parts, in_size, out_size).to(module.w13_weight.dtype)

    def loaded(self) -> set[str]:
        """The expert parameters every expert's every shard was loaded into; a partly loaded
        one is left out, so the loader reports it missing."""
        done = set()
        for target, seen in self.seen.items():
            shards = 1 if target.endswith("w2_weight") else 2
            moe = target.rsplit(".experts.", 1)[0]
            if len(seen) == self.num_experts[moe] * shards:
                done.add(target)
        return done
