"""8-bit weights and 8-bit activations (fp8 or int8): the scheme behind ``fp8`` checkpoints and
compressed-tensors' W8A8 formats.

    weight        [N, K]  fp8 / int8
    weight_scale  [N, 1]  per output channel    or one per checkpoint part (per tensor)
    input_scale   one per part (static activations), absent when activations are dynamic

    x [M, K] --quant (per token, or the static scale)--> q [M, K], s_x
    y = (q * s_x) @ (weight * weight_scale).T + bias     one scaled-GEMM kernel call
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from halserve.quant_methods.base import QuantMethod
from halserve.quant_methods.common import (
    add_param,
    add_shard_scale,
    drop_param,
    expand_shard_scales,
    gemm_weight,
    prepare_gemm_weight,
    shared_input_scale,
)

FP8 = "float8_e4m3fn"


@dataclass(frozen=True)
class W8A8Scheme:
    kind: Literal["fp8", "int8"]
    weight_strategy: Literal["channel", "tensor"]
    static_input: bool  # a checkpoint input_scale per part; else dynamic per-token scales


class ScaledW8A8Method(QuantMethod):
    """One ``W8A8Scheme`` for the layers it is given (built by a format's ``get_method_for_layer``)."""

    name = "w8a8"
    description = "8-bit weights and activations (fp8 or int8) through the scaled-GEMM kernels"

    def __init__(self, platform_name: str, scheme: W8A8Scheme, format_name: str) -> None:
        super().__init__(platform_name, None)
        self.scheme = scheme
        self.name = format_name  # shown per layer: the checkpoint's format

    @property
    def weight_dtype(self) -> torch.dtype:
        return getattr(torch, FP8) if self.scheme.kind == "fp8" else torch.int8

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        add_param(layer, "weight", (output_size, input_size), self.weight_dtype, input_dim=1, output_dim=0)
        layer.act_dtype = params_dtype
        if self.scheme.weight_strategy == "channel":
            add_param(layer, "weight_scale", (output_size, 1), torch.float32, output_dim=0)
        else:
            add_shard_scale(layer, "weight_scale")
        if self.scheme.static_input:
            add_shard_scale(layer, "input_scale")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from halserve.kernels import resolve_kernel

        scale = layer.weight_scale.data
        layer.w_scale = scale.float() if self.scheme.weight_strategy == "channel" else expand_shard_scales(layer, scale)
        drop_param(layer, "weight_scale")
        layer.x_scale = None
        if self.scheme.static_input:
            layer.x_scale = shared_input_scale(layer, layer.input_scale.data)
            drop_param(layer, "input_scale")
        act_dtype = str(layer.act_dtype).replace("torch.", "")
        n, k = layer.weight.shape
        if self.scheme.kind == "fp8":
            layer.gemm_kernel = resolve_kernel("fp8_scaled_gemm", self.platform_name, dtype=FP8, n=n, k=k,
                                               fp8_dtype=FP8)
            layer.quant_kernel = resolve_kernel("scaled_fp8_quant", self.platform_name, dtype=act_dtype,
                                                fp8_dtype=FP8)
        else:
            layer.gemm_kernel = resolve_kernel("int8_scaled_gemm", self.platform_name, dtype="int8", n=n, k=k)
            layer.quant_kernel = resolve_kernel("scaled_int8_quant", self.platform_name, dtype=act_dtype)
        prepare_gemm_weight(layer)

    def expert_weight_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("weight", "weight_scale"), ("input_scale",)

    def dequantize_weight(self, tensors: dict[str, torch.Tensor], input_size: int, output_size: int) -> torch.Tensor:
        scale = tensors["weight_scale"].float()  # one, or one per output channel
        return tensors["weight"].float() * (scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1))

    def quantize_input(self, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scheme.kind == "fp8":
            return layer.quant_kernel(x, FP8, layer.x_scale, per_token=layer.x_scale is None)
        return layer.quant_kernel(x, layer.x_scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        q, x_scale = self.quantize_input(layer, x)
        return layer.gemm_kernel(q, gemm_weight(layer), x_scale, layer.w_scale, x.dtype, bias)

    def __repr__(self) -> str:
        return f"<quant method {self.name} {self.scheme}>"

