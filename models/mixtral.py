"""Mixtral: the Mistral decoder (``llama.py``) with a sparse mixture-of-experts MLP in every layer.

    router    block_sparse_moe.gate [E, H]; softmax over the E experts, keep the top
              num_experts_per_tok, renormalised to sum to 1 over the kept ones
    experts   block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down): SwiGLU of intermediate_size

transformers 5 saved with ``save_original_format=False`` names the block ``mlp`` and fuses the
experts (``mlp.experts.gate_up_proj`` / ``down_proj``); both layouts load.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from halserve.layers import FusedMoE, ModelContext, ReplicatedLinear
from halserve.layers.fused_moe import ExpertWeightLoader
from halserve.models.llama import LlamaForCausalLM


class MixtralMoE(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"{prefix}: hidden_act {hf_config.hidden_act!r} is not supported (only 'silu')")
        hidden, num_experts = hf_config.hidden_size, hf_config.num_local_experts
        # (the router stays in floats in quantized checkpoints)
        self.gate = ctx.layer(ReplicatedLinear)(hidden, num_experts, False, ctx.without_quantization(), f"{prefix}.gate")
        self.experts = ctx.layer(FusedMoE)(num_experts, hf_config.num_experts_per_tok, hidden, hf_config.intermediate_size,
                                True, ctx, f"{prefix}.experts")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))  # router logits [T, E]


class MixtralForCausalLM(LlamaForCausalLM):
    """Llama's model-module protocol; only the MLPs and the expert weight names differ."""

    EXPERT_PROJ_NAMES = {"w1": "gate", "w3": "up", "w2": "down"}

    def __init__(self, hf_config: Any, ctx: ModelContext) -> None:
        super().__init__(hf_config, ctx, make_mlp=lambda i, prefix: MixtralMoE(hf_config, ctx, prefix))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = ((name.replace(".block_sparse_moe.", ".mlp."), tensor) for name, tensor in weights)
        experts = ExpertWeightLoader(self, self.EXPERT_PROJ_NAMES)
        loaded = super().load_weights(experts.load_or_pass(renamed))
        return loaded | experts.loaded()  # after the stream is consumed
