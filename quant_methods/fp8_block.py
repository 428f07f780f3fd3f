"""Block-wise fp8 ("fine-grained": DeepSeek-V3, Qwen3-*-FP8, compressed-tensors' block strategy).

    weight        [N, K] float8_e4m3fn
    weight_scale  [ceil(N/Bn), ceil(K/Bk)] float32   one per Bn x Bk block of the weight
                  (``weight_scale_inv`` in ``fp8`` checkpoints: the same multiplier, despite the name)
    activations   quantized per token per group of Bk inputs, dynamically

Tensor parallelism splits whole blocks: each part's output size and the per-rank input size of a
row-parallel layer must be multiples of the block. The scale rows load like packed rows
(``packed_dim``/``pack_factor`` = Bn), so merged layers place each part's block rows at its offset.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from halserve.quant_methods.base import QuantMethod
from halserve.quant_methods.common import add_param, gemm_weight, prepare_gemm_weight

FP8 = "float8_e4m3fn"


class Fp8BlockMethod(QuantMethod):
    name = "fp8-block"
    description = "block-scaled fp8 weights, per-token-group fp8 activations"

    def __init__(self, platform_name: str, block_size: tuple[int, int], scale_name: str, format_name: str) -> None:
        super().__init__(platform_name, None)
        self.block_n, self.block_k = (int(b) for b in block_size)
        self.scale_name = scale_name
        self.name = format_name

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        sizes = list(layer.output_partition_sizes)
        if len(sizes) > 1 or layer.tp_size > 1:
            if any(size % self.block_n for size in sizes):
                raise ValueError(f"{layer.prefix}: fp8 block size {self.block_n} must divide the output size of each "
                                 f"part per tensor-parallel rank, got {sizes}")
        if input_size != layer.input_size and input_size % self.block_k:
            raise ValueError(f"{layer.prefix}: fp8 block size {self.block_k} must divide the input size per "
                             f"tensor-parallel rank, got {input_size}")
        add_param(layer, "weight", (output_size, input_size), getattr(torch, FP8), input_dim=1, output_dim=0)
        scale_shape = (math.ceil(output_size / self.block_n), math.ceil(input_size / self.block_k))
        add_param(layer, self.scale_name, scale_shape, torch.float32, output_dim=0, input_dim=1,
                  packed_dim=0, pack_factor=self.block_n)
        layer.act_dtype = params_dtype

    def expert_weight_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("weight", self.scale_name), ("input_scale",)

    def dequantize_weight(self, tensors: dict[str, torch.Tensor], input_size: int, output_size: int) -> torch.Tensor:
        scale = tensors[self.scale_name].float()  # [ceil(N / bn), ceil(K / bk)]
        full = scale.repeat_interleave(self.block_n, 0).repeat_interleave(self.block_k, 1)
        return tensors["weight"].float() * full[:output_size, :input_size]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from halserve.kernels import resolve_kernel

        n, k = layer.weight.shape
        block = (self.block_n, self.block_k)
        layer.block_scale = getattr(layer, self.scale_name).data
        layer.gemm_kernel = resolve_kernel("fp8_block_scaled_gemm", self.platform_name, dtype=FP8, n=n, k=k,
                                           block_size=block, fp8_dtype=FP8)
        layer.quant_kernel = resolve_kernel("per_token_group_fp8_quant", self.platform_name,
                                            dtype=str(layer.act_dtype).replace("torch.", ""), fp8_dtype=FP8,
                                            group_size=self.block_k)
        prepare_gemm_weight(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        q, x_scale = layer.quant_kernel(x, FP8, self.block_k)
        return layer.gemm_kernel(q, gemm_weight(layer), x_scale, layer.block_scale, (self.block_n, self.block_k),
                                 x.dtype, bias)
