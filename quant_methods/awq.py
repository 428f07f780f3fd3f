"""AWQ checkpoints (AutoAWQ's GEMM version, ``quant_method: "awq"``), 4-bit with zero points.

    quantization_config: bits / w_bit 4, group_size / q_group_size, zero_point true, version "gemm",
                         modules_to_not_convert
    per layer:  qweight [K, N/8] int32, qzeros [K/G, N/8] int32, scales [K/G, N] fp16

Layers whose name contains an entry of ``modules_to_not_convert`` stay in floats (as in vLLM).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from halserve.quant_methods.base import QuantMethod
from halserve.quant_methods.common import add_param, checkpoint_names
from halserve.quant_methods.packed_int4 import PACK_FACTOR, PackedInt4Method


class AwqLinearMethod(PackedInt4Method):
    name = "awq"
    description = "AutoAWQ 4-bit (GEMM packing) through the awq_gemm kernel"
    op = "awq_gemm"
    kernel_arg_names = ("qweight", "qzeros", "scales")

    def __init__(self, platform_name: str, quant_config: dict[str, Any] | None = None) -> None:
        super().__init__(platform_name, quant_config)
        cfg = self.quant_config
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (only 'gemm', AutoAWQ's default packing)")
        if not cfg.get("zero_point", True):
            raise ValueError("AWQ checkpoints without zero points (zero_point: false) are not supported")
        self.modules_to_not_convert = list(cfg.get("modules_to_not_convert") or [])

    def get_method_for_layer(self, prefix: str) -> QuantMethod:
        from halserve.quant_methods.unquantized import UnquantizedLinearMethod

        names = [prefix, *checkpoint_names(prefix)]
        if any(module in name for module in self.modules_to_not_convert for name in names):
            return UnquantizedLinearMethod(self.platform_name)
        return self

    def expert_weight_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("qweight", "qzeros", "scales"), ()

    def dequantize_weight(self, tensors: dict[str, torch.Tensor], input_size: int, output_size: int) -> torch.Tensor:
        from halserve.kernels.packing import dequantize_awq

        return dequantize_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], self.group_size).t()

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        self.check_packable(layer, input_size, packed_output=True)
        num_groups, split = self.groups(layer, input_size)
        group_dim = 0 if split else None
        add_param(layer, "qweight", (input_size, output_size // PACK_FACTOR), torch.int32,
                  input_dim=0, output_dim=1, packed_dim=1, pack_factor=PACK_FACTOR)
        add_param(layer, "qzeros", (num_groups, output_size // PACK_FACTOR), torch.int32,
                  input_dim=group_dim, output_dim=1, packed_dim=1, pack_factor=PACK_FACTOR)
        add_param(layer, "scales", (num_groups, output_size), params_dtype, input_dim=group_dim, output_dim=1)
