"""DeepSeek-V2 and DeepSeek-V3 (one decoder, switched by ``model_type``): multi-head latent attention
over a latent KV cache (``halserve.layers.mla``), MoE with shared experts, dense first layers.

    differences        DeepSeek-V2 (deepseek_v2)                   DeepSeek-V3 (deepseek_v3)
    router scores      softmax(gate(x))                            sigmoid(gate(x)); choice adds
                                                                   e_score_correction_bias
    top-k              topk_method "greedy", or                    always grouped: groups ranked by
                       "group_limited_greedy": groups ranked by    their two best biased scores, keep
                       their best score, keep topk_group           topk_group
    weights            the chosen scores                           the chosen (unbiased) scores, / their
                                                                   sum when norm_topk_prob
    rotary layout      interleaved pairs                           interleaved when rope_interleave
                                                                   (default), else halves (neox)

Both: weights x routed_scaling_factor; shared experts are one SwiGLU of moe_intermediate_size *
n_shared_experts added to the routed sum; layers < first_k_dense_replace have a dense MLP of
intermediate_size. Attention (per layer, H heads): q from q_proj (V2-Lite: q_lora_rank None) or
q_a_proj -> RMSNorm -> q_b_proj, split into [qk_nope | qk_rope] per head; kv_a_proj_with_mqa gives the
latent [kv_lora_rank] (RMSNorm'd) and one shared rotary key [qk_rope]; kv_b_proj expands the latent to
per-head [k_nope | v]. Softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under
YaRN (transformers' ``yarn_apply_mscale``); the rotary table carries YaRN's own attention factor.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable
from itertools import islice
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from halserve.distributed import divide, get_pp_state, get_tp_size, tensor_model_parallel_all_reduce
from halserve.layers import (
    ColumnParallelLinear,
    FusedMoE,
    ModelContext,
    ParallelLMHead,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from halserve.layers.fused_moe import ExpertWeightLoader
from halserve.layers.mla import MLAAttention
from halserve.layers.rotary import ROPE_TYPE_ALIASES, ROPE_TYPES, RotaryEmbedding, rope_parameters_from_config
from halserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, model_type
from halserve.models.pipeline import make_layers

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def is_deepseek_mla(hf_config: Any) -> bool:
    """Whether a config is one of this module's (its layers keep an MLA latent cache)."""
    return model_type(hf_config) in MODEL_TYPES


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(hf_config: Any, rope_params: dict[str, Any]) -> float:
    """qk_head_dim^-0.5, with YaRN's mscale_all_dim correction squared (transformers' yarn_apply_mscale)."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    if rope_params.get("rope_type", "default") != "default":
        mscale_all_dim = rope_params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = yarn_mscale(rope_params["factor"], mscale_all_dim)
            scale = scale * m * m
    return scale


def make_rotary(hf_config: Any, ctx: ModelContext) -> RotaryEmbedding:
    """The rotary embedding of the qk_rope dims (shared by every layer)."""
    params = rope_parameters_from_config(hf_config)
    if ROPE_TYPE_ALIASES.get(params["rope_type"], params["rope_type"]) not in ROPE_TYPES:
        raise ValueError(f"rope type {params['rope_type']!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    interleaved = model_type(hf_config) == "deepseek_v2" or bool(getattr(hf_config, "rope_interleave", True))
    dim = hf_config.qk_rope_head_dim
    max_pos_emb = hf_config.max_position_embeddings
    return ctx.layer(RotaryEmbedding)(dim, dim, max(ctx.max_position or 0, max_pos_emb), params, max_pos_emb, ctx,
                                      is_neox=not interleaved, max_model_len=ctx.max_position)


class DeepseekAttention(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelContext, rotary: RotaryEmbedding, prefix: str) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        total_heads = hf_config.num_attention_heads
        self.num_heads = divide(total_heads, get_tp_size(), "num_attention_heads")
        self.qk_nope_head_dim, self.qk_rope_head_dim = hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = hf_config.v_head_dim, hf_config.kv_lora_rank
        self.q_lora_rank = getattr(hf_config, "q_lora_rank", None)
        bias = bool(getattr(hf_config, "attention_bias", False))
        eps = hf_config.rms_norm_eps
        if self.q_lora_rank is None:
            self.q_proj = ctx.layer(ColumnParallelLinear)(hidden, total_heads * self.qk_head_dim, False, ctx,
                                                          f"{prefix}.q_proj")
        else:
            self.q_a_proj = ctx.layer(ReplicatedLinear)(hidden, self.q_lora_rank, bias, ctx, f"{prefix}.q_a_proj")
            self.q_a_layernorm = ctx.layer(RMSNorm)(self.q_lora_rank, eps, ctx)
            self.q_b_proj = ctx.layer(ColumnParallelLinear)(self.q_lora_rank, total_heads * self.qk_head_dim, False,
                                                            ctx, f"{prefix}.q_b_proj")
        self.kv_a_proj_with_mqa = ctx.layer(ReplicatedLinear)(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias,
                                                              ctx, f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = ctx.layer(RMSNorm)(self.kv_lora_rank, eps, ctx)
        # (kept in the model dtype: its halves become the absorbed weights after loading)
        self.kv_b_proj = ctx.layer(ColumnParallelLinear)(
            self.kv_lora_rank, total_heads * (self.qk_nope_head_dim + self.v_head_dim), False,
            ctx.without_quantization(), f"{prefix}.kv_b_proj")
        self.o_proj = ctx.layer(RowParallelLinear)(total_heads * self.v_head_dim, hidden, bias, ctx, f"{prefix}.o_proj")
        self.rotary_emb = rotary
        self.attn = MLAAttention(self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim,
                                 self.kv_lora_rank, softmax_scale(hf_config, rope_parameters_from_config(hf_config)),
                                 ctx, prefix=f"{prefix}.attn")

    def process_weights_after_loading(self) -> None:
        """Called by the loader before ``kv_b_proj``'s own post-processing (which may repack its weight)."""
        weight = getattr(self.kv_b_proj, "weight", None)
        if weight is None or not weight.dtype.is_floating_point:
            raise ValueError(f"{self.attn.prefix}: kv_b_proj has no dense float weight to absorb")
        self.attn.set_absorbed_weights(weight)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(num_tokens, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_proj_with_mqa(hidden)  # [T, r + dr]
        kv_c, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe.reshape(num_tokens, -1), k_pe.contiguous())
        q_pe = q_pe.view(num_tokens, self.num_heads, self.qk_rope_head_dim)
        return self.o_proj(self.attn(q_nope, q_pe, kv_c, k_pe))


class DeepseekRouter(nn.Module):
    """``forward(hidden [T, H]) -> (topk_weights [T, k] float32, topk_ids [T, k])`` (module docstring).

    The gate (and V3's score-correction bias) stay float32, as transformers keeps them."""

    def __init__(self, hf_config: Any, prefix: str) -> None:
        super().__init__()
        self.is_v3 = model_type(hf_config) == "deepseek_v3"
        self.num_experts, self.top_k = hf_config.n_routed_experts, hf_config.num_experts_per_tok
        self.num_groups = getattr(hf_config, "n_group", None) or 1
        self.topk_group = getattr(hf_config, "topk_group", None) or self.num_groups
        self.routed_scaling_factor = float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0)
        self.norm_topk_prob = bool(getattr(hf_config, "norm_topk_prob", False))
        self.topk_method = "grouped" if self.is_v3 else (getattr(hf_config, "topk_method", None) or "greedy")
        if self.topk_method not in (*V2_TOPK_METHODS, "grouped"):
            raise ValueError(f"{prefix}: topk_method {self.topk_method!r} is not supported for DeepSeek-V2 "
                             f"(supported: {', '.join(V2_TOPK_METHODS)}); check the checkpoint's config.json")
        if self.topk_method != "greedy" and self.num_experts % self.num_groups:
            raise ValueError(f"{prefix}: n_routed_experts {self.num_experts} is not a multiple of n_group "
                             f"{self.num_groups}; check the checkpoint's config.json")
        self.weight = nn.Parameter(torch.empty(self.num_experts, hf_config.hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        if self.is_v3:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32),
                                                        requires_grad=False)

    def _group_mask(self, scores: torch.Tensor, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, E] bool: the experts of each token's ``topk_group`` best groups."""
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [T, G]
        per_group = self.num_experts // self.num_groups
        return group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(scores.shape[0], -1).bool()

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden.float(), self.weight)  # [T, E]
        per_group = self.num_experts // self.num_groups
        if self.is_v3:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            group_scores = choice.view(-1, self.num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
            choice = choice.masked_fill(~self._group_mask(choice, group_scores), float("-inf"))
            topk_ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            topk_weights = scores.gather(1, topk_ids)
            if self.norm_topk_prob:
                topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores = logits.softmax(dim=-1)
            if self.topk_method == "group_limited_greedy":
                group_scores = scores.view(-1, self.num_groups, per_group).max(dim=-1).values  # [T, G]
                scores = scores.masked_fill(~self._group_mask(scores, group_scores), 0.0)
            topk_weights, topk_ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return topk_weights * self.routed_scaling_factor, topk_ids


class DeepseekMoE(nn.Module):
    """Routed experts plus the shared ones; both partial sums are added, then all-reduced once."""

    def __init__(self, hf_config: Any, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"{prefix}: hidden_act {hf_config.hidden_act!r} is not supported (only 'silu')")
        self.gate = DeepseekRouter(hf_config, f"{prefix}.gate")
        # renormalize=False: the router returns final weights (FusedMoE's own softmax routing is unused)
        self.experts = ctx.layer(FusedMoE)(hf_config.n_routed_experts, hf_config.num_experts_per_tok,
                                           hf_config.hidden_size, hf_config.moe_intermediate_size, False, ctx,
                                           f"{prefix}.experts", reduce_results=False)
        self.shared_experts: LlamaMLP | None = None
        num_shared = getattr(hf_config, "n_shared_experts", None) or 0
        if num_shared:
            self.shared_experts = LlamaMLP(hf_config, ctx, f"{prefix}.shared_experts",
                                           intermediate_size=hf_config.moe_intermediate_size * num_shared,
                                           reduce_results=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(hidden)
        experts = self.experts
        out = experts.kernel(hidden, experts.w13_weight, experts.w2_weight, topk_weights, topk_ids)  # [T, H] partial
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return tensor_model_parallel_all_reduce(out)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelContext, rotary: RotaryEmbedding, layer_index: int,
                 prefix: str) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.input_layernorm = ctx.layer(RMSNorm)(hf_config.hidden_size, eps, ctx)
        self.self_attn = DeepseekAttention(hf_config, ctx, rotary, f"{prefix}.self_attn")
        self.post_attention_layernorm = ctx.layer(RMSNorm)(hf_config.hidden_size, eps, ctx)
        is_dense = layer_index < (getattr(hf_config, "first_k_dense_replace", 0) or 0)
        self.mlp = LlamaMLP(hf_config, ctx, f"{prefix}.mlp") if is_dense else DeepseekMoE(hf_config, ctx,
                                                                                            f"{prefix}.mlp")

    forward = LlamaDecoderLayer.forward  # (the same norms around attention and MLP; only the modules differ)


class DeepseekModel(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelContext, prefix: str = "model") -> None:
        super().__init__()
        self.embed_tokens = ctx.layer(VocabParallelEmbedding)(hf_config.vocab_size, hf_config.hidden_size, ctx)
        rotary = make_rotary(hf_config, ctx)
        self.start_layer, self.end_layer, self.layers = make_layers(
            hf_config.num_hidden_layers, lambda i, name: DeepseekDecoderLayer(hf_config, ctx, rotary, i, name), prefix)
        self.norm = ctx.layer(RMSNorm)(hf_config.hidden_size, hf_config.rms_norm_eps, ctx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # [T, H]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DeepseekForCausalLM(LlamaForCausalLM):
    """``DeepseekV2ForCausalLM`` and ``DeepseekV3ForCausalLM``: Llama's model-module protocol and loader
    (fused gate/up of dense MLPs and shared experts); attention layers are ``MLAAttention``."""

    supports_pipeline_parallel = False
    STACKED_PARAMS = [(".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1)]
    EXPERT_PROJ_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def __init__(self, hf_config: Any, ctx: ModelContext) -> None:
        nn.Module.__init__(self)
        kind = model_type(hf_config)
        if kind not in MODEL_TYPES:
            raise ValueError(f"DeepseekForCausalLM serves model_type {' or '.join(MODEL_TYPES)}, got {kind!r}; "
                             "check the checkpoint's config.json")
        if get_pp_state().size > 1:
            raise ValueError("DeepSeek-V2/V3 do not run with pipeline parallelism yet; use pipeline_parallel_size=1")
        self.config = hf_config
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # (Llama's attribute is a LlamaModel; the loader and protocol only need its modules)
        self.model: DeepseekModel = DeepseekModel(hf_config, ctx)  # type: ignore[assignment]
        self.lm_head = ctx.layer(ParallelLMHead)(hf_config.vocab_size, hf_config.hidden_size, ctx,
                                                 tie_to=self.model.embed_tokens if self.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if inputs_embeds is not None:
            raise ValueError("DeepSeek-V2/V3 are text-only: inputs_embeds is not supported")
        return self.model(input_ids, positions)

    @property
    def attention_layers(self) -> list[MLAAttention]:  # type: ignore[override]
        model = self.model
        layers = cast(list[DeepseekDecoderLayer], list(islice(model.layers, model.start_layer, model.end_layer)))
        return [layer.self_attn.attn for layer in layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        num_layers = self.config.num_hidden_layers
        # DeepSeek-V3 checkpoints append the multi-token-prediction layer (model.layers.61 of 61), unused here
        weights = ((name, tensor) for name, tensor in weights
                   if not ((m := _LAYER.match(name)) and int(m.group(1)) >= num_layers))
        experts = ExpertWeightLoader(self, self.EXPERT_PROJ_NAMES)
        loaded = super().load_weights(experts.load_or_pass(weights))
        return loaded | experts.loaded()
