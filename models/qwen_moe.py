"""Qwen2-MoE and Qwen3-MoE (one decoder, switched by ``model_type`` like ``llama.py``).

    differences       Qwen2-MoE (qwen2_moe)                      Qwen3-MoE (qwen3_moe)
    attention         q/k/v bias (qkv_bias), no o_proj bias      per-head q/k RMSNorm, attention_bias
    shared expert     mlp.shared_expert, an MLP of               none
                      shared_expert_intermediate_size, scaled by
                      sigmoid(mlp.shared_expert_gate(x))

Both: the router ``mlp.gate`` [E, H] takes a softmax over experts and keeps the top
num_experts_per_tok, renormalised to sum to 1 only when ``norm_topk_prob``; experts
``mlp.experts.{e}.gate_proj/up_proj/down_proj`` are SwiGLUs of moe_intermediate_size.
Layer i is sparse unless i is in ``mlp_only_layers``, ``num_experts`` is 0 or
``(i + 1) % decoder_sparse_step != 0``; dense layers are Llama MLPs of intermediate_size.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from halserve.distributed import tensor_model_parallel_all_reduce
from halserve.layers import FusedMoE, ModelContext, ReplicatedLinear
from halserve.layers.fused_moe import ExpertWeightLoader
from halserve.models.llama import LlamaForCausalLM, LlamaMLP, model_type

MODEL_TYPES = ("qwen2_moe", "qwen3_moe")


def is_sparse_layer(hf_config: Any, layer_index: int) -> bool:
    """The same rule as transformers' Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer."""
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return (layer_index not in (getattr(hf_config, "mlp_only_layers", None) or [])
            and hf_config.num_experts > 0 and (layer_index + 1) % step == 0)


class QwenMoeSparseBlock(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"{prefix}: hidden_act {hf_config.hidden_act!r} is not supported (only 'silu')")
        hidden, num_experts = hf_config.hidden_size, hf_config.num_experts
        has_shared = model_type(hf_config) == "qwen2_moe"
        # (the router and the shared expert's gate stay in floats in quantized checkpoints)
        self.gate = ctx.layer(ReplicatedLinear)(hidden, num_experts, False, ctx.without_quantization(), f"{prefix}.gate")
        # with a shared expert both partial sums are added first, so one all-reduce covers them
        self.experts = ctx.layer(FusedMoE)(num_experts, hf_config.num_experts_per_tok, hidden, hf_config.moe_intermediate_size,
                                bool(hf_config.norm_topk_prob), ctx, f"{prefix}.experts", reduce_results=not has_shared)
        self.shared_expert: LlamaMLP | None = None
        if has_shared:
            self.shared_expert = LlamaMLP(hf_config, ctx, f"{prefix}.shared_expert",
                                          intermediate_size=hf_config.shared_expert_intermediate_size,
                                          reduce_results=False)
            self.shared_expert_gate = ctx.layer(ReplicatedLinear)(hidden, 1, False, ctx.without_quantization(),
                                                       f"{prefix}.shared_expert_gate")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))  # [T, H]
        if self.shared_expert is None:
            return out
        # the sigmoid gate is per token, identical on every rank: scaling partial sums is exact
        out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return tensor_model_parallel_all_reduce(out)


class QwenMoeForCausalLM(LlamaForCausalLM):
    """Llama's model-module protocol; the MLPs and the expert weight names differ."""

    EXPERT_PROJ_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def __init__(self, hf_config: Any, ctx: ModelContext) -> None:
        kind = model_type(hf_config)
        if kind not in MODEL_TYPES:
            raise ValueError(f"QwenMoeForCausalLM serves model_type {' or '.join(MODEL_TYPES)}, got {kind!r}; "
                             "check the checkpoint's config.json")

        def make_mlp(i: int, prefix: str) -> nn.Module | None:
            return QwenMoeSparseBlock(hf_config, ctx, prefix) if is_sparse_layer(hf_config, i) else None

        super().__init__(hf_config, ctx, make_mlp=make_mlp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        experts = ExpertWeightLoader(self, self.EXPERT_PROJ_NAMES)
        loaded = super().load_weights(experts.load_or_pass(weights))
        return loaded | experts.loaded()  # after the stream is consumed
