"""The Gemma family: Gemma, Gemma 2 and Gemma 3 text (one decoder, switched by model_type).

    what                        gemma            gemma2                     gemma3_text
    norms                       x * (1 + w)      the same                   the same
    norms per layer             2                4 (sandwich)               4 (sandwich)
    per-head q/k RMSNorm        -                -                          yes
    embeddings                  * sqrt(hidden_size) rounded to the model dtype, in all three
    MLP                         gelu_tanh(gate) * up, in all three
    attention scale             head_dim^-0.5    query_pre_attn_scalar^-0.5 the same as gemma2
    attention logits soft-cap   -                attn_logit_softcapping     - (HF never applies it)
    final logits soft-cap       -                final_logit_softcapping    final_logit_softcapping
    sliding window layers       -                layer_types                layer_types
    rope                        rope_parameters  rope_parameters            rope_parameters[layer type]

transformers fills ``layer_types`` when a checkpoint's config lacks it (Gemma 2: every other
layer slides, starting with layer 0; Gemma 3: ``sliding_window_pattern``) and turns Gemma 3's
``rope_theta`` + ``rope_scaling`` (global layers) and ``rope_local_base_freq`` (sliding layers)
into one rope dict per layer type; both are read from there.

Forward works on the flattened batch: ``input_ids``/``positions`` [T] -> hidden [T, H].
"""
from __future__ import annotations

from itertools import islice
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from halserve.distributed import divide, get_pp_state, get_tp_size
from halserve.layers import (
    Attention,
    GeluAndMul,
    GemmaRMSNorm,
    MergedColumnParallelLinear,
    ModelContext,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope,
)
from halserve.layers.rotary import RotaryEmbedding
from halserve.models.llama import LlamaAttention, LlamaForCausalLM, head_size_of, layer_sliding_windows, norm_and_attend
from halserve.models.pipeline import IntermediateTensors, PPMissingLayer, make_layers

VERSIONS = {"gemma": 1, "gemma2": 2, "gemma3_text": 3}


def gemma_version(hf_config: Any) -> int:
    kind = getattr(hf_config, "model_type", None)
    if kind not in VERSIONS:
        raise ValueError(f"model_type {kind!r} is not a Gemma text model; expected one of {', '.join(VERSIONS)} "
                         "(multimodal Gemma 3 checkpoints, model_type 'gemma3', are not supported)")
    return VERSIONS[kind]


def attention_logits_soft_cap(hf_config: Any) -> float | None:
    """The cap on attention scores the model applies (None: none).

    Gemma 2 only: transformers' Gemma 3 keeps ``attn_logit_softcapping`` on its config but
    never passes it to attention, so a Gemma 3 checkpoint that sets it is served as HF runs it.
    """
    if getattr(hf_config, "model_type", None) != "gemma2":
        return None
    return getattr(hf_config, "attn_logit_softcapping", None)


def layer_types_of(hf_config: Any) -> list[str]:
    return list(getattr(hf_config, "layer_types", None) or ["full_attention"] * hf_config.num_hidden_layers)


def rope_for_layer_type(hf_config: Any, layer_type: str, head_size: int, ctx: ModelContext) -> RotaryEmbedding:
    """Gemma 3 keeps one rope dict per layer type (local layers: base 10k; global: 1M, maybe
    linear scaling); get_rope reads a flat one, so it gets a view holding just that dict."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type in params:
        view = SimpleNamespace(rope_parameters=dict(params[layer_type]),
                               max_position_embeddings=hf_config.max_position_embeddings)
        return get_rope(view, head_size, ctx)
    return get_rope(hf_config, head_size, ctx)


def _check_config(hf_config: Any, version: int) -> None:
    act_key = "hidden_act" if version == 1 else "hidden_activation"  # the field HF's Gemma<version> reads
    act = getattr(hf_config, act_key, None)
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{act_key} {act!r} is not supported for {hf_config.model_type}; "
                         "only 'gelu_pytorch_tanh' (the activation every Gemma checkpoint uses)")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True (a Gemma embedding variant) is not supported; "
                         "halserve serves Gemma as a causal decoder: set it to false or use a causal checkpoint")


class GemmaMLP(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        inter = hf_config.intermediate_size
        self.gate_up_proj = ctx.layer(MergedColumnParallelLinear)(hf_config.hidden_size, [inter, inter], False, ctx,
                                                       f"{prefix}.gate_up_proj")
        self.down_proj = ctx.layer(RowParallelLinear)(inter, hf_config.hidden_size, False, ctx, f"{prefix}.down_proj")
        self.act_fn = GeluAndMul(inter // get_tp_size(), ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, H] -> [T, 2I/tp] -> [T, I/tp] -> [T, H]


class GemmaAttention(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelContext, rotary: RotaryEmbedding, sliding_window: int | None,
                 prefix: str) -> None:
        super().__init__()
        version = gemma_version(hf_config)
        hidden = hf_config.hidden_size
        total_heads = hf_config.num_attention_heads
        total_kv_heads = getattr(hf_config, "num_key_value_heads", None) or total_heads
        self.head_size = head_size_of(hf_config)
        bias = bool(getattr(hf_config, "attention_bias", False))
        self.qkv_proj = ctx.layer(QKVParallelLinear)(hidden, self.head_size, total_heads, total_kv_heads, bias, ctx,
                                          f"{prefix}.qkv_proj")
        self.o_proj = ctx.layer(RowParallelLinear)(total_heads * self.head_size, hidden, bias, ctx, f"{prefix}.o_proj")
        self.num_heads = divide(total_heads, get_tp_size(), "num_attention_heads")
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.rotary_emb = rotary
        self.has_qk_norm = version == 3
        if self.has_qk_norm:
            self.q_norm = ctx.layer(GemmaRMSNorm)(self.head_size, hf_config.rms_norm_eps, ctx)
            self.k_norm = ctx.layer(GemmaRMSNorm)(self.head_size, hf_config.rms_norm_eps, ctx)
        scale = self.head_size**-0.5 if version == 1 else hf_config.query_pre_attn_scalar**-0.5
        self.attn = Attention(self.num_heads, self.head_size, scale, self.num_kv_heads, ctx,
                              sliding_window=sliding_window, logits_soft_cap=attention_logits_soft_cap(hf_config),
                              prefix=f"{prefix}.attn")

    forward = LlamaAttention.forward  # (the same projections, q/k norms and rotary; only the modules differ)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelContext, rotary: RotaryEmbedding, sliding_window: int | None,
                 prefix: str) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.input_layernorm = ctx.layer(GemmaRMSNorm)(hidden, eps, ctx)
        self.self_attn = GemmaAttention(hf_config, ctx, rotary, sliding_window, f"{prefix}.self_attn")
        self.post_attention_layernorm = ctx.layer(GemmaRMSNorm)(hidden, eps, ctx)
        self.mlp = GemmaMLP(hf_config, ctx, f"{prefix}.mlp")
        self.has_sandwich_norms = gemma_version(hf_config) >= 2
        if self.has_sandwich_norms:
            self.pre_feedforward_layernorm = ctx.layer(GemmaRMSNorm)(hidden, eps, ctx)
            self.post_feedforward_layernorm = ctx.layer(GemmaRMSNorm)(hidden, eps, ctx)

    def forward(self, positions, hidden, residual):
        hidden, residual = norm_and_attend(self, positions, hidden, residual)
        if not self.has_sandwich_norms:  # Gemma: post_attention_layernorm is the pre-MLP norm
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        # Gemma 2/3 norm each sub-block's output before adding it to the stream
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(nn.Module):
    """Pipeline stages as in ``LlamaModel``."""

    def __init__(self, hf_config: Any, ctx: ModelContext, prefix: str = "model", keep_embedding: bool = False) -> None:
        super().__init__()
        pp = get_pp_state()
        self.is_first_stage, self.is_last_stage = pp.is_first, pp.is_last
        self.embed_tokens = (ctx.layer(VocabParallelEmbedding)(hf_config.vocab_size, hf_config.hidden_size, ctx)
                             if pp.is_first or (keep_embedding and pp.is_last) else PPMissingLayer())
        # HF multiplies by sqrt(H) as a tensor of the model dtype (bfloat16: sqrt(3072) becomes 55.5)
        self.normalizer = torch.tensor(hf_config.hidden_size**0.5, dtype=ctx.dtype).item()
        head_size = head_size_of(hf_config)
        layer_types = layer_types_of(hf_config)
        # one rope table per layer type, shared by the layers of that type
        ropes = {t: rope_for_layer_type(hf_config, t, head_size, ctx) for t in dict.fromkeys(layer_types)}
        windows = layer_sliding_windows(hf_config)
        self.start_layer, self.end_layer, self.layers = make_layers(
            hf_config.num_hidden_layers,
            lambda i, name: GemmaDecoderLayer(hf_config, ctx, ropes[layer_types[i]], windows[i], name),
            prefix,
        )
        self.norm = (ctx.layer(GemmaRMSNorm)(hf_config.hidden_size, hf_config.rms_norm_eps, ctx) if pp.is_last
                     else PPMissingLayer())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        if self.is_first_stage:
            hidden = self.embed_tokens(input_ids) * self.normalizer  # [T, H]
            residual = None
        else:
            hidden, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden, residual = layer(positions, hidden, residual)
        if not self.is_last_stage:
            return {"hidden_states": hidden, "residual": residual}
        hidden, _ = self.norm(hidden, residual)
        return hidden


class GemmaForCausalLM(nn.Module):
    """Gemma, Gemma 2 and Gemma 3 text; the model-module protocol of ``LlamaForCausalLM``."""

    # the same HF weight names and q/k/v, gate/up fusion as the Llama family
    STACKED_PARAMS = LlamaForCausalLM.STACKED_PARAMS
    load_weights = LlamaForCausalLM.load_weights
    supports_pipeline_parallel = True

    def __init__(self, hf_config: Any, ctx: ModelContext) -> None:
        super().__init__()
        _check_config(hf_config, gemma_version(hf_config))
        self.config = hf_config
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.model = GemmaModel(hf_config, ctx, keep_embedding=self.tie_word_embeddings)
        self.lm_head = (ctx.layer(ParallelLMHead)(hf_config.vocab_size, hf_config.hidden_size, ctx,
                                       tie_to=self.model.embed_tokens if self.tie_word_embeddings else None)
                        if get_pp_state().is_last else PPMissingLayer())
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)

    forward = LlamaForCausalLM.forward

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)  # [N, vocab] float32
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    attention_layers = LlamaForCausalLM.attention_layers
