"""LoRA-wrapped linear layers: the base layer's output plus, per token, its adapter's term.

    y[t] = x[t] W^T (+ bias) + (x[t] A_a^T) B_a^T        a = the adapter of token t's request

Each wrapped layer keeps, per loaded adapter, one rank-local pair ``(A [R, in_local],
B [out_local, R])`` with the scaling folded into B. Fused layers stack their shards'
adapters: qkv_proj with q, k and v targeted holds ``A = [A_q; A_k; A_v]`` (R = 3r) and a
block-diagonal B, so one pair of matmuls serves every shard::

    B [out_local, 3r] =  | B_q  0    0   |   rows of this rank's q heads
                         | 0    B_k  0   |   rows of its kv heads
                         | 0    0    B_v |

An adapter of a checkpoint whose module is itself fused (Phi-3's qkv_proj) has one A for all
shards; the manager hands each shard its rows of B with that same A, and shards given the
same A share its rows of the stacked A (R = r, B = [B_q; B_k; B_v] in one column block).

Tensor parallelism shards the adapter like the weight it adapts: a column-parallel layer
(outputs split) takes B's rows of this rank and the whole A; a row-parallel layer (inputs
split) takes A's columns of this rank and the whole B, and adds its partial term *before*
the all-reduce, which sums the ranks' partial terms into the full one exactly once.

The step's token -> adapter mapping is one ``LoRABatch`` shared by every wrapped layer;
the model runner fills it before each forward (empty: nothing is added).

The Transformers modeling backend's layers see transformers' activations ([1, T, in]: the
wrappers flatten any leading dims) and may take a whole input of which a row-parallel rank
multiplies its slice (``split_input``, a ``rowwise_split_input`` plan entry).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from halserve.distributed import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from halserve.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from halserve.lora.peft import adapter_error

if TYPE_CHECKING:  # pragma: no cover
    from halserve.lora.request import LoRARequest

LoRAPair = tuple[torch.Tensor, torch.Tensor]  # (A [R, in_local], scaling * B [out_local, R])


@dataclass(slots=True)
class LoRABatch:
    """This step's adapters: ``(lora_int_id, token indices [n] on the device, or None for
    every token)``; tokens of requests without an adapter appear in no group."""

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)


class BaseLinearWithLoRA(nn.Module):
    """Wraps one linear layer; subclasses define the split (which slice of A and B a rank holds)."""

    def __init__(self, base_layer: LinearBase, batch: LoRABatch) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.batch = batch
        self.lora_weights: dict[int, LoRAPair] = {}  # adapters on the device, by lora_int_id

    def shard_ids(self) -> list[Any]:
        """The checkpoint shards this layer fuses (``[None]`` for a plain layer)."""
        return [None]

    def _slice(self, shard_id: Any, a: torch.Tensor, b: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(output offset in this rank's output, A for this rank, B rows for this rank)."""
        raise NotImplementedError

    def full_sizes(self, shard_id: Any) -> tuple[int, int]:
        """(inputs, outputs) of the checkpoint's whole (unsharded) module ``shard_id``."""
        raise NotImplementedError

    def prepare(self, lora: LoRARequest, modules: dict[Any, tuple[str, torch.Tensor, torch.Tensor]],
                scaling: float, dtype: torch.dtype) -> LoRAPair:
        """This rank's stacked pair for ``modules`` (shard id -> (module name, A [r, in], B [out, r])).
        Shards given the same A tensor (one fused checkpoint module) share its rows of the stacked A."""
        base = self.base_layer
        a_rows: list[torch.Tensor] = []  # this rank's A of each distinct checkpoint lora_A
        a_column: dict[int, int] = {}  # id() of a checkpoint lora_A -> its first row in the stacked A
        blocks = []  # (output offset, first column in B, B rows of this rank)
        for shard_id, (name, a, b) in modules.items():
            num_in, num_out = self.full_sizes(shard_id)
            r = a.shape[0]
            if a.shape[1] != num_in or b.shape != (num_out, r):
                raise adapter_error(
                    lora, f"module {name!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                    f"model's layer of {num_in} inputs and {num_out} outputs (expected ({r}, {num_in}) and "
                    f"({num_out}, {r})); the adapter was trained for a different base model")
            offset, a_local, b_local = self._slice(shard_id, a.float(), b.float() * scaling)
            # (a rank's slice of A never depends on the shard, so one A's slice serves all its shards)
            if id(a) not in a_column:
                a_column[id(a)] = sum(rows.shape[0] for rows in a_rows)
                a_rows.append(a_local)
            blocks.append((offset, a_column[id(a)], b_local))
        a_cat = torch.cat(a_rows)  # [R, in_local]
        b_cat = torch.zeros(base.output_size_per_partition, a_cat.shape[0])
        for offset, col, b in blocks:
            b_cat[offset : offset + b.shape[0], col : col + b.shape[1]] = b
        return a_cat.to(dtype).contiguous(), b_cat.to(dtype).contiguous()

    def add_lora(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y += (x A^T) B^T`` for each group of tokens, in place. x [T, in_local], y [T, out_local]."""
        for lora_id, index in self.batch.groups:
            pair = self.lora_weights.get(lora_id)
            if pair is None:  # the adapter does not target this layer
                continue
            a, b = pair
            if index is None:
                y.addmm_(F.linear(x, a), b.t())
            else:
                y.index_add_(0, index, F.linear(F.linear(x.index_select(0, index), a), b))

    def extra_repr(self) -> str:
        return f"loaded_loras={sorted(self.lora_weights)}"


class ColumnParallelLinearWithLoRA(BaseLinearWithLoRA):
    """Column-parallel and replicated layers (whole input on every rank)."""

    def shard_ids(self) -> list[Any]:
        base = self.base_layer
        if isinstance(base, QKVParallelLinear):
            return list(QKVParallelLinear.SHARDS)
        if isinstance(base, ColumnParallelLinear) and len(base.output_sizes) > 1:
            return list(range(len(base.output_sizes)))
        return [None]

    def full_sizes(self, shard_id: Any) -> tuple[int, int]:
        base = self.base_layer
        if shard_id is None:
            return base.input_size, base.output_size
        _, size = base._shard_offset_size(shard_id)
        replicas = base.kv_replicas if isinstance(base, QKVParallelLinear) and shard_id != "q" else 1
        return base.input_size, size * base.tp_size // replicas

    def _slice(self, shard_id, a, b):
        base = self.base_layer
        if isinstance(base, ReplicatedLinear):
            return 0, a, b
        if shard_id is None:
            offset, size, start = 0, base.output_size_per_partition, base.tp_rank * base.output_size_per_partition
        else:
            offset, size = base._shard_offset_size(shard_id)
            start = base._shard_rank_start(shard_id) * size
        return offset, a, b.narrow(0, start, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        lead, x = _flatten(x)
        y = base.quant_method.apply(base, x, base.bias)  # [T, out_local]
        if self.batch.groups:
            self.add_lora(x, y)
        y = tensor_model_parallel_all_gather(y) if getattr(base, "gather_output", False) else y
        return y.view(*lead, y.shape[-1])


class RowParallelLinearWithLoRA(BaseLinearWithLoRA):
    """Inputs split across ranks: A's columns of this rank, the partial term added before the all-reduce."""

    def full_sizes(self, shard_id: Any) -> tuple[int, int]:
        return self.base_layer.input_size, self.base_layer.output_size

    def _slice(self, shard_id, a, b):
        base = self.base_layer
        size = base.input_size_per_partition
        return 0, a.narrow(1, base.tp_rank * size, size), b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        lead, x = _flatten(x)
        if getattr(base, "split_input", False):  # (x arrives whole: this rank multiplies its slice)
            x = x.narrow(-1, base.tp_rank * base.input_size_per_partition, base.input_size_per_partition)
        y = base.quant_method.apply(base, x, base.bias if base.tp_rank == 0 else None)  # partial sum [T, out]
        if self.batch.groups:
            self.add_lora(x, y)
        y = tensor_model_parallel_all_reduce(y) if base.reduce_results else y
        return y.view(*lead, y.shape[-1])


def _flatten(x: torch.Tensor) -> tuple[torch.Size, torch.Tensor]:
    """(leading dims, x as [T, in]): the Transformers backend's layers see transformers' [1, T, in]."""
    return x.shape[:-1], x.reshape(-1, x.shape[-1])


def wrap_linear(layer: nn.Module, batch: LoRABatch) -> BaseLinearWithLoRA | None:
    """The LoRA wrapper of ``layer``, or None when it is not a linear layer LoRA can target."""
    if isinstance(layer, RowParallelLinear):
        return RowParallelLinearWithLoRA(layer, batch)
    if isinstance(layer, (ColumnParallelLinear, ReplicatedLinear)):
        return ColumnParallelLinearWithLoRA(layer, batch)
    return None


__all__ = ["BaseLinearWithLoRA", "ColumnParallelLinearWithLoRA", "LoRABatch", "RowParallelLinearWithLoRA",
           "wrap_linear"]
