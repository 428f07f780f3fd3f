"""compressed-tensors' W4A16 (``pack-quantized`` int4 weights, float activations).

Checkpoint tensors per layer (compressed-tensors packs signed int4 ``q`` as ``u = q + 8``, eight to
an int32 along the last dim, element i in bits 4i..4i+3)::

    weight_packed      [N, K/8]      int32
    weight_scale       [N, K/G]      (G = K for per-channel)
    weight_zero_point  [N/8, K/G]    int32, packed along N (asymmetric only), stored as zp + 8
    weight_shape       [2]           the unpacked [N, K]
    weight_g_idx       [K]           act-order "group" checkpoints only

    W[n, k] = (u[n, k] - z[n, g(k)]) * s[n, g(k)]        z = 8 when symmetric

After loading it becomes GPTQ's layout (``weight_packed.T`` already is GPTQ's ``qweight``; the
zeros 8 are stored as 7), or AWQ's when asymmetric without act-order (GPTQ v1 cannot store a zero
of 0), and runs on the platform's ``gptq_gemm`` / ``awq_gemm``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from halserve.kernels.packing import _pack_nibbles, _unpack_nibbles, pack_awq, pack_gptq
from halserve.quant_methods.common import add_param, drop_param
from halserve.quant_methods.gptq import _g_idx_loader
from halserve.quant_methods.packed_int4 import PACK_FACTOR, PackedInt4Method


class CompressedTensorsW4A16(PackedInt4Method):
    name = "compressed-tensors"
    description = "compressed-tensors W4A16 through the gptq_gemm / awq_gemm kernels"

    def __init__(self, platform_name: str, group_size: int, symmetric: bool, act_order: bool = False) -> None:
        super().__init__(platform_name, {"bits": 4, "group_size": group_size})
        self.symmetric, self.act_order = symmetric, act_order
        if act_order and not symmetric:
            raise ValueError("compressed-tensors W4A16 with both act-order and asymmetric zeros is not supported")

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        self.check_packable(layer, input_size, packed_output=True)
        if input_size % PACK_FACTOR:
            raise ValueError(f"{layer.prefix}: int4 packing needs the input size per rank ({input_size}) "
                             f"to be a multiple of {PACK_FACTOR}")
        num_groups, split = self.groups(layer, input_size)
        if self.act_order and split:
            num_groups, split = layer.input_size // self.group_size, False
        group_dim = 1 if split else None
        add_param(layer, "weight_packed", (output_size, input_size // PACK_FACTOR), torch.int32,
                  output_dim=0, input_dim=1, packed_dim=1, pack_factor=PACK_FACTOR)
        add_param(layer, "weight_scale", (output_size, num_groups), params_dtype, output_dim=0, input_dim=group_dim)
        if not self.symmetric:
            add_param(layer, "weight_zero_point", (output_size // PACK_FACTOR, num_groups), torch.int32,
                      output_dim=0, input_dim=group_dim, packed_dim=0, pack_factor=PACK_FACTOR)
        add_param(layer, "weight_shape", (2,), torch.int64, weight_loader=_shape_checker(layer))
        if self.act_order:
            add_param(layer, "weight_g_idx", (input_size,), torch.int32, input_dim=0,
                      weight_loader=_g_idx_loader(layer)).data.fill_(-1)

    def expert_weight_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        names = ("weight_packed", "weight_scale", "weight_shape")
        names += () if self.symmetric else ("weight_zero_point",)
        return names + (("weight_g_idx",) if self.act_order else ()), ()

    def dequantize_weight(self, tensors: dict[str, torch.Tensor], input_size: int, output_size: int) -> torch.Tensor:
        u = _unpack_nibbles(tensors["weight_packed"], dim=1).float()  # [N, K], 0..15
        scales = tensors["weight_scale"].float()  # [N, groups]
        g_idx = tensors.get("weight_g_idx")
        groups = (torch.arange(u.shape[1]) // (u.shape[1] // scales.shape[1]) if g_idx is None else g_idx).long()
        zeros = 8.0 if self.symmetric else _unpack_nibbles(tensors["weight_zero_point"], dim=0).float()[:, groups]
        return (u - zeros) * scales[:, groups]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        packed = layer.weight_packed.data  # [N, K/8]
        scales = layer.weight_scale.data.t().contiguous()  # [groups, N]
        num_groups, n = scales.shape
        g_idx = layer.weight_g_idx.data if self.act_order else None
        if self.symmetric:
            self.op, self.kernel_arg_names = "gptq_gemm", ("qweight", "qzeros", "scales", "g_idx")
            layer.qweight = packed.t().contiguous()  # [K/8, N]: the same nibbles along K
            sevens = torch.full((num_groups, n), 7, dtype=torch.int32, device=packed.device)
            layer.qzeros = _pack_nibbles(sevens, dim=1)  # GPTQ v1 stores zero - 1
            layer.g_idx = g_idx
        else:
            zeros = _unpack_nibbles(layer.weight_zero_point.data, dim=0).t().contiguous()  # [groups, N]
            q = _unpack_nibbles(packed, dim=1).t().contiguous()  # [K, N]
            if g_idx is None:
                self.op, self.kernel_arg_names = "awq_gemm", ("qweight", "qzeros", "scales")
                layer.qweight, layer.qzeros, _ = pack_awq(q, zeros, scales)
            else:
                self.op, self.kernel_arg_names = "gptq_gemm", ("qweight", "qzeros", "scales", "g_idx")
                layer.qweight, layer.qzeros, _ = pack_gptq(q, zeros, scales)
                layer.g_idx = g_idx
            drop_param(layer, "weight_zero_point")
        layer.scales = scales
        for name in ("weight_packed", "weight_scale", "weight_shape", "weight_g_idx"):
            drop_param(layer, name)
        super().process_weights_after_loading(layer)


def _shape_checker(layer: nn.Module):
    """``weight_shape`` is only checked: its input size must be the layer's."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if int(loaded[1]) != layer.input_size:
            raise ValueError(f"{layer.prefix}: checkpoint weight_shape {loaded.tolist()} has input size "
                             f"{int(loaded[1])}, expected {layer.input_size}")
        param.data.copy_(loaded)

    return load
