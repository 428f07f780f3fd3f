"""compressed-tensors checkpoints (llm-compressor's output, ``quant_method: "compressed-tensors"``).

The checkpoint's ``config_groups`` give schemes and the layers they target (``"Linear"``, names or
``re:`` regexes); ``ignore`` lists the layers left in floats. Schemes served:

| scheme (llm-compressor preset)    | weights                      | activations           | kernels          |
|-----------------------------------|------------------------------|-----------------------|------------------|
| W4A16, W4A16_ASYM                 | int4 groups/channels, packed | float                 | gptq_gemm / awq_gemm |
| W8A8 (INT8)                       | int8 per channel / tensor    | int8 per token/static | int8_scaled_gemm |
| FP8, FP8_DYNAMIC                  | fp8 per tensor / channel     | fp8 per token/static  | fp8_scaled_gemm  |
| FP8_BLOCK                         | fp8 per 128x128 block        | fp8 per token-group   | fp8_block_scaled_gemm |

Others (int weight-only with 8 bits, fp4 / mx formats, sparsity, asymmetric activations, a KV-cache
scheme) are refused with their description.
"""
from __future__ import annotations

from typing import Any

from halserve.quant_methods.base import QuantMethod
from halserve.quant_methods.common import is_layer_listed
from halserve.quant_methods.compressed_tensors_w4a16 import CompressedTensorsW4A16
from halserve.quant_methods.fp8_block import Fp8BlockMethod
from halserve.quant_methods.w8a8 import ScaledW8A8Method, W8A8Scheme

NAME = "compressed-tensors"


class CompressedTensorsMethod(QuantMethod):
    name = NAME
    description = "llm-compressor checkpoints: W4A16, W8A8 int8, FP8 (per tensor/channel/block)"

    def __init__(self, platform_name: str, quant_config: dict[str, Any] | None = None) -> None:
        super().__init__(platform_name, quant_config)
        cfg = self.quant_config
        if not cfg:
            raise ValueError("--quantization compressed-tensors needs a checkpoint with a compressed-tensors "
                             "quantization_config (it cannot quantize a float checkpoint)")
        if cfg.get("kv_cache_scheme"):
            raise ValueError(f"compressed-tensors kv_cache_scheme {cfg['kv_cache_scheme']} is not supported; "
                             "serve the checkpoint with --kv-cache-dtype instead")
        if (cfg.get("sparsity_config") or {}).get("format") not in (None, "dense"):
            raise ValueError(f"compressed-tensors sparsity {cfg['sparsity_config']} is not supported")
        self.ignore = list(cfg.get("ignore") or [])
        self.groups = []  # (targets, scheme method factory) in the checkpoint's order
        for group_name, group in (cfg.get("config_groups") or {}).items():
            fmt = group.get("format") or cfg.get("format")
            self.groups.append((list(group.get("targets") or []), _scheme(group_name, group, fmt)))

    def get_method_for_layer(self, prefix: str) -> QuantMethod:
        from halserve.quant_methods.unquantized import UnquantizedLinearMethod

        if is_layer_listed(prefix, self.ignore, "compressed-tensors ignore"):
            return UnquantizedLinearMethod(self.platform_name)
        for targets, make in self.groups:
            names = [t for t in targets if t != "Linear"]
            if "Linear" in targets or is_layer_listed(prefix, names, "compressed-tensors targets"):
                return make(self.platform_name)
        return UnquantizedLinearMethod(self.platform_name)


def _scheme(group_name: str, group: dict[str, Any], fmt: str | None):
    """A factory ``platform_name -> QuantMethod`` for one config group, or a ValueError naming it."""
    weights = group.get("weights") or {}
    inputs = group.get("input_activations")
    desc = (f"compressed-tensors {group_name} (format {fmt!r}, weights {_brief(weights)}, "
            f"input activations {_brief(inputs) if inputs else 'float'})")
    w_type, w_bits, w_strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if group.get("output_activations"):
        raise ValueError(f"{desc}: quantized output activations are not supported")
    if inputs is None and w_type == "int" and w_bits == 4 and fmt == "pack-quantized":
        if w_strategy not in ("group", "channel"):
            raise ValueError(f"{desc}: 4-bit weights need strategy group or channel")
        group_size = int(weights["group_size"]) if w_strategy == "group" else -1
        symmetric = bool(weights.get("symmetric", True))
        act_order = weights.get("actorder") == "group"
        return lambda platform: CompressedTensorsW4A16(platform, group_size, symmetric, act_order)
    if inputs is not None and w_bits == 8 and inputs.get("num_bits") == 8 and w_type == inputs.get("type"):
        if not weights.get("symmetric", True) or not inputs.get("symmetric", True):
            raise ValueError(f"{desc}: asymmetric 8-bit weights or activations are not supported")
        kind = {"int": "int8", "float": "fp8"}.get(w_type)
        if kind == "fp8" and w_strategy == "block":
            block = weights.get("block_structure") or [128, 128]
            if inputs.get("strategy") != "group" or int(inputs.get("group_size") or 0) != int(block[1]):
                raise ValueError(f"{desc}: block fp8 weights need activations per token-group of {block[1]}")
            return lambda platform: Fp8BlockMethod(platform, tuple(block), "weight_scale", NAME)
        if kind is not None and w_strategy in ("channel", "tensor"):
            dynamic = bool(inputs.get("dynamic"))
            if not dynamic and inputs.get("strategy") != "tensor":
                raise ValueError(f"{desc}: static activation scales must be per tensor")
            if dynamic and inputs.get("strategy") not in ("token", "tensor"):
                raise ValueError(f"{desc}: dynamic activations must be per token or per tensor")
            scheme = W8A8Scheme(kind, w_strategy, static_input=not dynamic)
            return lambda platform: ScaledW8A8Method(platform, scheme, NAME)
    raise ValueError(f"{desc} is not supported; halserve serves W4A16 (pack-quantized int4), W8A8 int8, "
                     "and FP8 (per tensor, per channel or 128x128 blocks) schemes")


def _brief(args: dict[str, Any]) -> str:
    keys = ("type", "num_bits", "strategy", "group_size", "block_structure", "symmetric", "dynamic")
    return "{" + ", ".join(f"{k}={args.get(k)}" for k in keys if args.get(k) is not None) + "}"

