"""Linear layers with tensor parallelism; the matmul itself belongs to the quant method.

    ColumnParallelLinear   W [N, K] split along N: each rank computes its slice of outputs
    RowParallelLinear      W [N, K] split along K: each rank a partial sum, then all-reduce
    MergedColumnParallel   several column layers fused along N (gate_up_proj = [gate; up])
    QKVParallelLinear      q, k, v fused along N; kv heads replicated when tp > num_kv_heads
    ReplicatedLinear       no split

Loading: each parameter gets ``weight_loader(param, loaded_weight, shard_id=None)`` (unless
the quant method attached its own). It uses the parameter's ``output_dim``/``input_dim``
attributes to cut this rank's slice out of the full checkpoint tensor and, for merged
layers, to place logical shard ``shard_id`` (0/1 for gate/up, "q"/"k"/"v") at its offset.
"""
from __future__ import annotations

import torch
from torch import nn

from halserve.distributed import (
    divide,
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from halserve.layers.context import ModelContext
from halserve.quant_methods.base import set_weight_attrs


def _packed(param: nn.Parameter, dim: int, size: int) -> int:
    """A logical size along ``dim`` in stored elements (int4 packs 8 values per int32)."""
    if getattr(param, "packed_dim", None) == dim:
        return size // param.pack_factor
    return size


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor for {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


class LinearBase(nn.Module):
    """Holds the quant method and an optional bias; subclasses define the split."""

    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: ModelContext, prefix: str,
                 output_partition_sizes: list[int] | None = None, input_is_split: bool = False) -> None:
        super().__init__()
        self.prefix = prefix
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size, self.output_size = input_size, output_size
        # TP-local sizes, what the quant method allocates
        self.input_size_per_partition = input_size // self.tp_size if input_is_split else input_size
        self.output_partition_sizes = output_partition_sizes or [output_size]
        self.output_size_per_partition = sum(self.output_partition_sizes)
        self.quant_method = ctx.linear_method(prefix)
        self.quant_method.create_weights(self, self.input_size_per_partition, self.output_size_per_partition, ctx.dtype)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=ctx.dtype), requires_grad=False)
            set_weight_attrs(self.bias, {"output_dim": 0})
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            if not hasattr(param, "weight_loader"):
                param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (f"in={self.input_size_per_partition}, out={self.output_size_per_partition}, "
                f"bias={self.bias is not None}, tp={self.tp_size}, method={self.quant_method.name}")


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: ModelContext, prefix: str = "") -> None:
        super().__init__(input_size, output_size, bias, ctx, prefix)

    def weight_loader(self, param, loaded, shard_id=None):
        _copy_checked(param.data, loaded, self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.quant_method.apply(self, x, self.bias)
        out = self.quant_method.apply(self, x.reshape(-1, x.shape[-1]), self.bias)  # [..., in] as rows
        return out.view(*x.shape[:-1], out.shape[-1])


def vision_linear(input_size: int, output_size: int, ctx: ModelContext, prefix: str = "",
                  bias: bool = True) -> ReplicatedLinear:
    """A vision tower's linear layer: replicated on every tensor-parallel rank, never quantized (a
    quantized checkpoint quantizes its decoder), out of LoRA's reach (``no_lora``), and on the
    platform's GEMM kernel like the decoder's (CPU: oneDNN's prepacked weights, ~2.5x torch's default
    on the vision towers' shapes here)."""
    layer = ctx.layer(ReplicatedLinear)(input_size, output_size, bias, ctx.without_quantization(), prefix)
    layer.no_lora = True
    return layer


class ColumnParallelLinear(LinearBase):
    """``y = x W^T``, W split along outputs; ``gather_output`` all-gathers the full y."""

    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: ModelContext, prefix: str = "",
                 gather_output: bool = False, output_sizes: list[int] | None = None) -> None:
        tp = get_tp_size()
        self.output_sizes = output_sizes or [output_size]
        local = [divide(s, tp, f"{prefix} output size") for s in self.output_sizes]
        self.gather_output = gather_output
        super().__init__(input_size, output_size, bias, ctx, prefix, output_partition_sizes=local)

    def _shard_offset_size(self, shard_id) -> tuple[int, int]:
        """(local offset, local size) of logical shard ``shard_id`` along the output dim."""
        index = int(shard_id)
        return sum(self.output_partition_sizes[:index]), self.output_partition_sizes[index]

    def weight_loader(self, param, loaded, shard_id=None):
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:  # replicated (e.g. a per-tensor scale)
            _copy_checked(param.data, loaded.reshape(param.shape), self.prefix)
            return
        dst = param.data
        if shard_id is None:
            size = dst.shape[output_dim]
            start = self.tp_rank * size
        else:
            offset, size = self._shard_offset_size(shard_id)
            offset, size = _packed(param, output_dim, offset), _packed(param, output_dim, size)
            dst = dst.narrow(output_dim, offset, size)
            start = self._shard_rank_start(shard_id) * size
        _copy_checked(dst, loaded.narrow(output_dim, start, size), f"{self.prefix} (shard {shard_id})")

    def _shard_rank_start(self, shard_id) -> int:
        """Which slice (in units of the local shard size) this rank takes from the checkpoint."""
        return self.tp_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)  # [T, local out]
        return tensor_model_parallel_all_gather(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column layers of the same input fused along outputs; checkpoint shard i of
    ``output_sizes`` loads with ``shard_id=i`` (gate_up_proj: 0 = gate, 1 = up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, ctx: ModelContext, prefix: str = "") -> None:
        super().__init__(input_size, sum(output_sizes), bias, ctx, prefix, output_sizes=list(output_sizes))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused: output = [q heads | k heads | v heads] of this rank.

    With more ranks than kv heads each kv head is replicated on ``tp / num_kv_heads`` ranks.
    """

    SHARDS = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool, ctx: ModelContext, prefix: str = "") -> None:
        tp = get_tp_size()
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp, f"{prefix} num_heads")
        if tp >= total_num_kv_heads:
            divide(tp, total_num_kv_heads, f"{prefix} ranks per kv head")
            self.num_kv_heads, self.kv_replicas = 1, tp // total_num_kv_heads
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp, f"{prefix} num_kv_heads")
            self.kv_replicas = 1
        sizes = [self.num_heads * head_size, self.num_kv_heads * head_size, self.num_kv_heads * head_size]
        # output_sizes given as global sizes: the local ones are sizes * tp / tp
        super().__init__(hidden_size, (total_num_heads + 2 * total_num_kv_heads) * head_size, bias, ctx, prefix,
                         output_sizes=[s * tp for s in sizes])

    def _shard_offset_size(self, shard_id):
        if shard_id not in self.SHARDS:
            raise ValueError(f"QKV shard_id must be one of {self.SHARDS}, got {shard_id!r}")
        return super()._shard_offset_size(self.SHARDS.index(shard_id))

    def _shard_rank_start(self, shard_id) -> int:
        return self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas


class RowParallelLinear(LinearBase):
    """``y = x W^T``, W split along inputs: each rank holds x's matching slice
    (``input_is_parallel``) and the partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: ModelContext, prefix: str = "",
                 reduce_results: bool = True) -> None:
        divide(input_size, get_tp_size(), f"{prefix} input size")
        self.reduce_results = reduce_results
        super().__init__(input_size, output_size, bias, ctx, prefix, input_is_split=True)

    def weight_loader(self, param, loaded, shard_id=None):
        input_dim = getattr(param, "input_dim", None)
        if input_dim is None:  # bias and per-tensor values are whole on every rank
            _copy_checked(param.data, loaded.reshape(param.shape), self.prefix)
            return
        size = param.shape[input_dim]
        _copy_checked(param.data, loaded.narrow(input_dim, self.tp_rank * size, size), self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # bias on rank 0 only, so the all-reduce adds it exactly once
        y = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        return tensor_model_parallel_all_reduce(y) if self.reduce_results else y
