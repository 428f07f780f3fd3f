"""``quant_method: "fp8"`` checkpoints, and ``--quantization fp8`` on a float checkpoint.

Three cases:
- per-tensor fp8 checkpoints (vLLM's / llm-compressor's older format): ``weight`` fp8, scalar
  ``weight_scale``, and a scalar ``input_scale`` when ``activation_scheme`` is ``"static"``;
- block-wise checkpoints (``weight_block_size: [Bn, Bk]``, e.g. Qwen3-*-FP8): ``weight`` fp8 and
  ``weight_scale_inv`` per block, activations per token-group (``fp8_block.py``);
- a float checkpoint served with ``--quantization fp8``: each weight is quantized at load to fp8
  with one scale per output channel; activations are quantized per token on the fly.

``ignored_layers`` / ``modules_to_not_convert`` stay in floats.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from halserve.quant_methods.base import QuantMethod
from halserve.quant_methods.common import add_param, is_layer_listed
from halserve.quant_methods.fp8_block import Fp8BlockMethod
from halserve.quant_methods.w8a8 import FP8, ScaledW8A8Method, W8A8Scheme


class Fp8LinearMethod(QuantMethod):
    name = "fp8"
    description = "fp8 checkpoints (per tensor or block-wise), or fp8 quantization of a float checkpoint at load"

    def __init__(self, platform_name: str, quant_config: dict[str, Any] | None = None) -> None:
        super().__init__(platform_name, quant_config)
        cfg = self.quant_config
        self.serialized = cfg.get("quant_method") == "fp8"
        scheme = cfg.get("activation_scheme", "dynamic")
        if scheme not in ("static", "dynamic"):
            raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported (static or dynamic)")
        self.block_size = cfg.get("weight_block_size")
        if self.block_size is not None and (len(self.block_size) != 2 or scheme != "dynamic"):
            raise ValueError(f"fp8 weight_block_size {self.block_size} needs two sizes and dynamic activations")
        self.skip = list(cfg.get("ignored_layers") or cfg.get("modules_to_not_convert") or [])
        self.static_input = scheme == "static"

    def get_method_for_layer(self, prefix: str) -> QuantMethod:
        from halserve.quant_methods.unquantized import UnquantizedLinearMethod

        if is_layer_listed(prefix, self.skip, "fp8 ignored_layers"):
            return UnquantizedLinearMethod(self.platform_name)
        if not self.serialized:
            return Fp8OnlineMethod(self.platform_name)
        if self.block_size is not None:
            return Fp8BlockMethod(self.platform_name, tuple(self.block_size), "weight_scale_inv", self.name)
        return ScaledW8A8Method(self.platform_name, W8A8Scheme("fp8", "tensor", self.static_input), self.name)


class Fp8OnlineMethod(ScaledW8A8Method):
    """Float weights in the checkpoint, fp8 in memory: quantized per output channel after loading."""

    def __init__(self, platform_name: str) -> None:
        super().__init__(platform_name, W8A8Scheme("fp8", "channel", False), "fp8")

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        add_param(layer, "weight", (output_size, input_size), params_dtype, input_dim=1, output_dim=0)
        layer.act_dtype = params_dtype

    def expert_weight_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("weight",), ()  # (a float checkpoint: experts keep the model dtype)

    def dequantize_weight(self, tensors: dict[str, torch.Tensor], input_size: int, output_size: int) -> torch.Tensor:
        return tensors["weight"]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data.float()
        fp8 = getattr(torch, FP8)
        scale = (weight.abs().amax(dim=1, keepdim=True) / torch.finfo(fp8).max).clamp(min=1e-12)  # [N, 1]
        layer.weight.data = (weight / scale).to(fp8)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        super().process_weights_after_loading(layer)
