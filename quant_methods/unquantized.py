"""Plain dense weights in the model dtype, multiplied by the platform's ``gemm`` kernel."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from halserve.quant_methods.base import QuantMethod, set_weight_attrs
from halserve.quant_methods.common import gemm_weight, prepare_gemm_weight

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn


class UnquantizedLinearMethod(QuantMethod):
    name = "unquantized"
    description = "dense weights in the model dtype through the gemm kernel"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        from halserve.kernels import resolve_kernel

        weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1})
        layer.register_parameter("weight", weight)
        # Resolved once per layer, never per call (DESIGN.md section 4).
        dtype_name = str(params_dtype).replace("torch.", "")
        layer.gemm_kernel = resolve_kernel("gemm", self.platform_name, dtype=dtype_name, n=output_size, k=input_size)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        prepare_gemm_weight(layer)  # e.g. oneDNN's blocked layout, the dense copy dropped

    def expert_weight_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("weight",), ()

    def dequantize_weight(self, tensors: dict[str, torch.Tensor], input_size: int, output_size: int) -> torch.Tensor:
        return tensors["weight"]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return layer.gemm_kernel(x, gemm_weight(layer), bias)
