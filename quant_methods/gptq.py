"""GPTQ checkpoints (AutoGPTQ / GPTQModel, ``quant_method: "gptq"``), 4-bit, v1 packing.

    quantization_config: bits 4, group_size (-1: per channel), desc_act (act-order), sym,
                         checkpoint_format "gptq" (v1), modules_in_block_to_quantize, dynamic
    per layer:  qweight [K/8, N] int32, qzeros [K/G, N/8] int32, scales [K/G, N] fp16, g_idx [K] int32

Layers a checkpoint leaves in floats: those outside ``modules_in_block_to_quantize`` (when given)
and those a ``dynamic`` rule skips (``"-:<regex>"``). Other ``dynamic`` rules (per-layer bits or
group sizes) are refused.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from halserve.quant_methods.base import QuantMethod
from halserve.quant_methods.common import add_param, checkpoint_names, is_layer_listed
from halserve.quant_methods.packed_int4 import PACK_FACTOR, PackedInt4Method


class GptqLinearMethod(PackedInt4Method):
    name = "gptq"
    description = "GPTQ 4-bit (v1 packing, act-order) through the gptq_gemm kernel"
    op = "gptq_gemm"
    kernel_arg_names = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, platform_name: str, quant_config: dict[str, Any] | None = None) -> None:
        super().__init__(platform_name, quant_config)
        cfg = self.quant_config
        fmt = str(cfg.get("checkpoint_format", "gptq")).lower()
        if fmt != "gptq":
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (only 'gptq', the v1 packing "
                             "GPTQModel saves by default)")
        self.desc_act = bool(cfg.get("desc_act", False))
        if cfg.get("lm_head"):
            raise ValueError("GPTQ checkpoints with a quantized lm_head are not supported")
        self.skip_patterns: list[str] = []
        for rule, override in (cfg.get("dynamic") or {}).items():
            if rule.startswith("-:"):
                self.skip_patterns.append("re:" + rule[2:])
            elif override:
                raise ValueError(f"GPTQ 'dynamic' rule {rule!r} changes {sorted(override)} for some layers; "
                                 "per-layer overrides are not supported (only '-:' rules that skip layers)")
        blocks = cfg.get("modules_in_block_to_quantize")
        self.quantized_parts = None if not blocks else [
            name for block in blocks for name in (block if isinstance(block, list) else [block])]

    def get_method_for_layer(self, prefix: str) -> QuantMethod:
        from halserve.quant_methods.unquantized import UnquantizedLinearMethod

        if is_layer_listed(prefix, self.skip_patterns, "GPTQ dynamic"):
            return UnquantizedLinearMethod(self.platform_name)
        if self.quantized_parts is not None and not is_layer_listed(prefix, self.quantized_parts,
                                                                    "modules_in_block_to_quantize"):
            return UnquantizedLinearMethod(self.platform_name)
        return self

    def expert_weight_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        names = ("qweight", "qzeros", "scales")
        return (names + ("g_idx",), ()) if self.desc_act else (names, ("g_idx",))

    def dequantize_weight(self, tensors: dict[str, torch.Tensor], input_size: int, output_size: int) -> torch.Tensor:
        from halserve.kernels.packing import dequantize_gptq

        return dequantize_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("g_idx"),
                               self.group_size).t()

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        self.check_packable(layer, input_size, packed_output=True)
        if input_size % PACK_FACTOR:
            raise ValueError(f"{layer.prefix}: GPTQ packs 8 input rows per int32; input size {input_size} per rank")
        num_groups, split = self.groups(layer, input_size)
        if self.desc_act and split:
            # act-order rows of this rank point anywhere among the global groups: keep them all
            num_groups, split = layer.input_size // self.group_size, False
        group_dim = 0 if split else None
        add_param(layer, "qweight", (input_size // PACK_FACTOR, output_size), torch.int32,
                  input_dim=0, output_dim=1, packed_dim=0, pack_factor=PACK_FACTOR)
        add_param(layer, "qzeros", (num_groups, output_size // PACK_FACTOR), torch.int32,
                  input_dim=group_dim, output_dim=1, packed_dim=1, pack_factor=PACK_FACTOR)
        add_param(layer, "scales", (num_groups, output_size), params_dtype, input_dim=group_dim, output_dim=1)
        # without act-order the rows are in group order: some writers leave g_idx out
        g_idx = add_param(layer, "g_idx", (input_size,), torch.int32, input_dim=0,
                          weight_loader=_g_idx_loader(layer), optional=not self.desc_act)
        g_idx.data.fill_(-1)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.desc_act:
            layer.g_idx = None  # rows are in group order: the kernels' fast path
        elif bool((layer.g_idx.data < 0).any()):
            raise ValueError(f"{layer.prefix}: desc_act is set but the checkpoint has no g_idx for "
                             f"{', '.join(checkpoint_names(layer.prefix))}")
        super().process_weights_after_loading(layer)


def _g_idx_loader(layer: nn.Module):
    """g_idx is one vector for a fused layer: its parts read the same input, so GPTQ gives them the
    same act-order (same Hessian); a checkpoint where they differ cannot be fused and is refused."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        size = param.shape[0]
        start = layer.tp_rank * size if size != loaded.shape[0] else 0
        part = loaded.narrow(0, start, size).to(torch.int32)
        if bool((param.data >= 0).all()) and not torch.equal(param.data, part):
            raise ValueError(f"{layer.prefix}: the parts {', '.join(checkpoint_names(layer.prefix))} have different "
                             "act-order g_idx, so halserve cannot run them as one fused layer")
        param.data.copy_(part)

    return load
