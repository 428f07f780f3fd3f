"""Bamba (IBM/Princeton/UIUC): a decoder of Mamba2 layers with a few Llama-style attention layers.

    layer i                  mixer                                 read from
    i in attn_layer_indices  attention (rope on half of each head)  num_attention_heads, num_key_value_heads
    else                     Mamba2 (layers/mamba2.py)              mamba_n_heads, mamba_d_head, mamba_n_groups,
                                                                    mamba_d_state, mamba_d_conv, mamba_expand
    every layer: input_layernorm -> mixer -> + residual -> pre_ff_layernorm -> SwiGLU feed_forward -> + residual

The Mamba2 layers keep one state per request in the KV-cache pool (``MambaSpec``, one group of layers
per spec like any hybrid model: ``halserve.kv_cache.spec``), so chunked prefill carries it across
chunks, and preemption or abort frees it with the request's blocks. Prefix caching is off for it (the
KV-cache manager says so in the log). One tensor-parallel rank, one pipeline stage.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from halserve.distributed import get_pp_state, get_tp_size
from halserve.kv_cache.spec import FullAttentionSpec, KVCacheSpec, MambaSpec
from halserve.layers import ModelContext, ParallelLMHead, RMSNorm, VocabParallelEmbedding, get_rope
from halserve.layers.mamba2 import MambaMixer2
from halserve.layers.rotary import RotaryEmbedding
from halserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, head_size_of


def _num_kv_heads(hf_config: Any) -> int:
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def attention_layer_indices(hf_config: Any) -> set[int]:
    return set(getattr(hf_config, "attn_layer_indices", None) or ())


def _mamba_dims(hf_config: Any) -> dict[str, Any]:
    """The Mamba2 mixer's sizes from a Bamba config ("auto" head dim: expand * hidden / heads)."""
    num_heads = hf_config.mamba_n_heads
    head_dim = hf_config.mamba_d_head
    if head_dim == "auto" or head_dim is None:
        head_dim = hf_config.mamba_expand * hf_config.hidden_size // num_heads
    limit = getattr(hf_config, "time_step_limit", None) or (0.0, float("inf"))
    return dict(hidden_size=hf_config.hidden_size, num_heads=num_heads, head_dim=int(head_dim),
                num_groups=hf_config.mamba_n_groups, state_size=hf_config.mamba_d_state,
                conv_kernel=hf_config.mamba_d_conv, use_conv_bias=bool(hf_config.mamba_conv_bias),
                use_bias=bool(hf_config.mamba_proj_bias), eps=hf_config.rms_norm_eps,
                time_step_limit=(float(limit[0]), float(limit[1])))


def page_token_elements(hf_config: Any) -> int:
    """Elements one token takes in one attention layer's page (K and V): what a Mamba state is cut into."""
    return 2 * _num_kv_heads(hf_config) * head_size_of(hf_config)


def bamba_kv_cache_specs(hf_config: Any) -> tuple[KVCacheSpec, ...]:
    """One spec per decoder layer: full attention, or the Mamba2 layer's state (``models/kv_cache_specs.py``)."""
    dims = _mamba_dims(hf_config)
    conv_dim = dims["num_heads"] * dims["head_dim"] + 2 * dims["num_groups"] * dims["state_size"]
    mamba = MambaSpec((conv_dim, dims["conv_kernel"] - 1), (dims["num_heads"], dims["head_dim"], dims["state_size"]),
                      page_token_elements(hf_config))
    attention = attention_layer_indices(hf_config)
    return tuple(FullAttentionSpec() if i in attention else mamba for i in range(hf_config.num_hidden_layers))


class BambaDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelContext, rotary: RotaryEmbedding, is_attention: bool,
                 prefix: str) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.is_attention = is_attention
        self.input_layernorm = ctx.layer(RMSNorm)(hf_config.hidden_size, eps, ctx)
        if is_attention:
            self.self_attn = LlamaAttention(hf_config, ctx, rotary, None, f"{prefix}.self_attn")
        else:
            self.mamba = MambaMixer2(**_mamba_dims(hf_config), page_token_elements=page_token_elements(hf_config),
                                     ctx=ctx, prefix=f"{prefix}.mamba")
        self.pre_ff_layernorm = ctx.layer(RMSNorm)(hf_config.hidden_size, eps, ctx)
        self.feed_forward = LlamaMLP(hf_config, ctx, f"{prefix}.feed_forward")

    @property
    def cache_layer(self) -> nn.Module:
        """What keeps this layer's KV-cache entries: its ``Attention`` or its Mamba2 mixer."""
        return self.self_attn.attn if self.is_attention else self.mamba

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden) if self.is_attention else self.mamba(hidden)
        hidden, residual = self.pre_ff_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class BambaModel(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelContext) -> None:
        super().__init__()
        self.embed_tokens = ctx.layer(VocabParallelEmbedding)(hf_config.vocab_size, hf_config.hidden_size, ctx)
        attention = attention_layer_indices(hf_config)
        rotary = get_rope(hf_config, head_size_of(hf_config), ctx) if attention else None
        self.layers = nn.ModuleList(BambaDecoderLayer(hf_config, ctx, rotary, i in attention, f"model.layers.{i}")
                                    for i in range(hf_config.num_hidden_layers))
        self.start_layer, self.end_layer = 0, hf_config.num_hidden_layers
        self.final_layernorm = ctx.layer(RMSNorm)(hf_config.hidden_size, hf_config.rms_norm_eps, ctx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, H]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.final_layernorm(hidden, residual)
        return hidden


class BambaForCausalLM(LlamaForCausalLM):
    """The model-module protocol of ``LlamaForCausalLM``; ``attention_layers`` lists every layer that keeps
    KV-cache entries (``Attention`` or ``MambaMixer2``), in layer order, as ``model_kv_cache_specs`` does."""

    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, ctx: ModelContext) -> None:
        nn.Module.__init__(self)
        if get_tp_size() > 1 or get_pp_state().size > 1:
            raise ValueError("BambaForCausalLM runs on one rank: use tensor_parallel_size=1 and "
                             "pipeline_parallel_size=1")
        if not attention_layer_indices(hf_config):
            raise ValueError("BambaForCausalLM needs at least one attention layer (attn_layer_indices): its Mamba2 "
                             "states are kept in the attention layers' KV-cache pages")
        self.config = hf_config
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = BambaModel(hf_config, ctx)
        self.lm_head = ctx.layer(ParallelLMHead)(hf_config.vocab_size, hf_config.hidden_size, ctx,
                                                 tie_to=self.model.embed_tokens if self.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if inputs_embeds is not None:
            raise ValueError("BambaForCausalLM takes token ids, not inputs_embeds")
        return self.model(input_ids, positions)

    @property
    def attention_layers(self) -> list[nn.Module]:  # type: ignore[override]
        return [layer.cache_layer for layer in self.model.layers]
