"""What GPTQ and AWQ (and compressed-tensors' W4A16) share: 4-bit weights in groups of input rows,
multiplied by the platform's ``gptq_gemm`` / ``awq_gemm`` kernel (packing: ``halserve.kernels.packing``).

    x [M, K] -> kernel(x, qweight | prepared, *rest) [M, N] (+ bias)

Tensor parallelism. Column-parallel layers split N, row-parallel ones split K; a row-parallel
split must keep whole groups on each rank (``K / tp`` a multiple of the group size). One group
over all of K (``group_size = -1``) and GPTQ's act-order ``g_idx`` keep their scales whole on
every rank instead (the rank's rows index the global groups).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from halserve.quant_methods.base import QuantMethod

PACK_FACTOR = 8  # 4-bit values per int32


class PackedInt4Method(QuantMethod):
    """Subclasses set ``op`` and ``kernel_arg_names`` (the op's arguments after x, in order, as
    layer attribute names; ``group_size`` is the method's) and create the parameters."""

    op: ClassVar[str]
    kernel_arg_names: ClassVar[tuple[str, ...]]

    def __init__(self, platform_name: str, quant_config: dict[str, Any] | None = None) -> None:
        super().__init__(platform_name, quant_config)
        bits = int(self.quant_config.get("bits", self.quant_config.get("w_bit", 4)))
        if bits != 4:
            raise ValueError(f"{self.name} checkpoints with bits={bits} are not supported yet (4-bit only)")
        self.group_size = int(self.quant_config.get("group_size", self.quant_config.get("q_group_size", 128)))

    def groups(self, layer: nn.Module, input_size: int) -> tuple[int, bool]:
        """(number of groups this rank holds, whether they are split across ranks)."""
        full_k = layer.input_size
        split = input_size != full_k
        if self.group_size == -1:
            return 1, False
        if self.group_size <= 0 or full_k % self.group_size:
            raise ValueError(f"{layer.prefix}: group_size {self.group_size} does not divide the input size {full_k}")
        if split and input_size % self.group_size:
            raise ValueError(f"{layer.prefix}: {input_size} input features per tensor-parallel rank is not a multiple "
                             f"of group_size {self.group_size}; use a tensor-parallel size that keeps groups whole")
        return input_size // self.group_size if split else full_k // self.group_size, split

    @staticmethod
    def check_packable(layer: nn.Module, input_size: int, packed_output: bool) -> None:
        sizes = layer.output_partition_sizes if packed_output else [input_size]
        if any(size % PACK_FACTOR for size in sizes):
            which = "output size of each part" if packed_output else "input size"
            raise ValueError(f"{layer.prefix}: 4-bit packing needs the {which} to be a multiple of "
                             f"{PACK_FACTOR} per tensor-parallel rank, got {sizes}")

    def kernel_args(self, layer: nn.Module) -> tuple:
        return tuple(getattr(layer, name) for name in self.kernel_arg_names) + (self.group_size,)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from halserve.kernels import resolve_kernel

        dtype_name = str(layer.scales.dtype).replace("torch.", "")
        layer.int4_kernel = resolve_kernel(self.op, self.platform_name, dtype=dtype_name,
                                           n=layer.output_size_per_partition, k=layer.input_size_per_partition,
                                           group_size=self.group_size)
        args = self.kernel_args(layer)
        prepared = layer.int4_kernel.prepare_weight(args)  # the default gives ``args`` back
        layer.prepared_qweight = None
        if prepared is not args and prepared is not layer.qweight:
            # the kernel's own layout replaces the checkpoint's: not held twice
            layer.prepared_qweight = prepared
            layer.qweight.data = torch.empty(0, dtype=layer.qweight.dtype, device=layer.qweight.device)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        args = self.kernel_args(layer)
        if layer.prepared_qweight is not None:
            args = (layer.prepared_qweight,) + args[1:]
        out = layer.int4_kernel(x, *args)
        return out if bias is None else out + bias
