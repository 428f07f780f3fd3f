"""The Llama family: Llama, Mistral, Qwen2 and Qwen3 (one decoder, switched by config; Qwen2-VL's and
Qwen2.5-VL's text models are Qwen2's).

    differences                         read from
    q/k/v bias                          attention_bias (Llama, Qwen3); always on for Qwen2;
                                        qkv_bias (Qwen2-MoE)
    o_proj bias                         attention_bias (Llama, Qwen3); never for Qwen2(-MoE)
    mlp bias                            mlp_bias (Llama)
    per-head RMSNorm on q and k         Qwen3, Qwen3-MoE
    head_dim != hidden / heads          head_dim
    sliding window                      Mistral: sliding_window on every layer;
                                        Qwen2/3: layer_types, else use_sliding_window +
                                        max_window_layers (layers >= it slide)
    tied embeddings                     tie_word_embeddings

Forward works on the flattened batch: ``input_ids``/``positions`` [T] -> hidden [T, H].
MoE models (``mixtral.py``, ``qwen_moe.py``) reuse this decoder with their own MLP per
layer through ``make_mlp``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from itertools import islice
from typing import Any

import torch
from torch import nn

from halserve.distributed import divide, get_pp_state, get_tp_size
from halserve.layers import (
    Attention,
    MergedColumnParallelLinear,
    ModelContext,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    get_rope,
)
from halserve.layers.rotary import RotaryEmbedding
from halserve.models.pipeline import IntermediateTensors, PPMissingLayer, is_other_stage_weight, make_layers

logger = logging.getLogger(__name__)

# decoders that are another one's under a different model_type
MODEL_TYPE_ALIASES = {
    "qwen2_vl_text": "qwen2",  # Qwen2-VL's and Qwen2.5-VL's text configs (their M-RoPE: get_rope)
    "qwen2_5_vl_text": "qwen2",
}


def model_type(hf_config: Any) -> str:
    kind = str(getattr(hf_config, "model_type", "llama") or "llama")
    return MODEL_TYPE_ALIASES.get(kind, kind)


def head_size_of(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def layer_sliding_windows(hf_config: Any) -> list[int | None]:
    """The sliding window of each layer (None = full attention)."""
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    kind = model_type(hf_config)
    if kind in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if not getattr(hf_config, "use_sliding_window", False):
            return [None] * num_layers
    if window is None:
        return [None] * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if kind in ("qwen2", "qwen3"):
        first = getattr(hf_config, "max_window_layers", 0)
        return [window if i >= first else None for i in range(num_layers)]
    return [window] * num_layers


# (layer index, module prefix) -> that layer's MLP, or None for the dense LlamaMLP
MlpFactory = Callable[[int, str], "nn.Module | None"]


class LlamaMLP(nn.Module):
    """``intermediate_size`` overrides the config's (a MoE shared expert); ``reduce_results=False``
    leaves the down projection's partial sums for the caller to all-reduce."""

    def __init__(self, hf_config: Any, ctx: ModelContext, prefix: str, intermediate_size: int | None = None,
                 reduce_results: bool = True) -> None:
        super().__init__()
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"{prefix}: hidden_act {hf_config.hidden_act!r} is not supported (only 'silu')")
        bias = bool(getattr(hf_config, "mlp_bias", False))
        inter = hf_config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = ctx.layer(MergedColumnParallelLinear)(hf_config.hidden_size, [inter, inter], bias, ctx,
                                                       f"{prefix}.gate_up_proj")
        self.down_proj = ctx.layer(RowParallelLinear)(inter, hf_config.hidden_size, bias, ctx, f"{prefix}.down_proj",
                                           reduce_results=reduce_results)
        self.act_fn = SiluAndMul(inter // get_tp_size(), ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, H] -> [T, 2I/tp] -> [T, I/tp] -> [T, H]


class LlamaAttention(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelContext, rotary: RotaryEmbedding, sliding_window: int | None,
                 prefix: str) -> None:
        super().__init__()
        tp = get_tp_size()
        hidden = hf_config.hidden_size
        total_heads = hf_config.num_attention_heads
        total_kv_heads = getattr(hf_config, "num_key_value_heads", None) or total_heads
        self.head_size = head_size_of(hf_config)
        kind = model_type(hf_config)
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        qkv_bias = True if kind == "qwen2" else bool(getattr(hf_config, "qkv_bias", attention_bias))
        o_bias = False if kind in ("qwen2", "qwen2_moe") else attention_bias
        self.qkv_proj = ctx.layer(QKVParallelLinear)(hidden, self.head_size, total_heads, total_kv_heads, qkv_bias, ctx,
                                          f"{prefix}.qkv_proj")
        self.o_proj = ctx.layer(RowParallelLinear)(total_heads * self.head_size, hidden, o_bias, ctx, f"{prefix}.o_proj")
        self.num_heads = divide(total_heads, tp, "num_attention_heads")
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.rotary_emb = rotary
        self.has_qk_norm = kind in ("qwen3", "qwen3_moe")
        if self.has_qk_norm:
            self.q_norm = ctx.layer(RMSNorm)(self.head_size, hf_config.rms_norm_eps, ctx)
            self.k_norm = ctx.layer(RMSNorm)(self.head_size, hf_config.rms_norm_eps, ctx)
        self.attn = Attention(self.num_heads, self.head_size, self.head_size**-0.5, self.num_kv_heads, ctx,
                              sliding_window=sliding_window, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, (Hq + 2 Hk) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.has_qk_norm:  # per head: [T * H, D]
            q = self.q_norm(q.reshape(-1, self.head_size)).view(-1, self.q_size)
            k = self.k_norm(k.reshape(-1, self.head_size)).view(-1, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous()))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelContext, rotary: RotaryEmbedding, sliding_window: int | None,
                 prefix: str, mlp: nn.Module | None = None) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.input_layernorm = ctx.layer(RMSNorm)(hf_config.hidden_size, eps, ctx)
        self.self_attn = LlamaAttention(hf_config, ctx, rotary, sliding_window, f"{prefix}.self_attn")
        self.post_attention_layernorm = ctx.layer(RMSNorm)(hf_config.hidden_size, eps, ctx)
        self.mlp = mlp if mlp is not None else LlamaMLP(hf_config, ctx, f"{prefix}.mlp")

    def forward(self, positions, hidden, residual):
        hidden, residual = norm_and_attend(self, positions, hidden, residual)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def norm_and_attend(layer: nn.Module, positions: torch.Tensor, hidden: torch.Tensor,
                    residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention half of a pre-norm decoder layer (``layer.input_layernorm``, then ``layer.self_attn``):
    (the attention's output, the residual stream). ``residual`` carries the un-normed stream (None in the
    first layer); the norm fuses the add of the previous layer's output into it."""
    if residual is None:
        residual = hidden
        hidden = layer.input_layernorm(hidden)
    else:
        hidden, residual = layer.input_layernorm(hidden, residual)
    return layer.self_attn(positions, hidden), residual


class LlamaModel(nn.Module):
    """The decoder. Under pipeline parallelism it holds only its stage's layers (``start_layer`` ..
    ``end_layer``; ``models/pipeline.py``): the first stage embeds, the last one applies the final
    norm, and the others return their ``IntermediateTensors``."""

    def __init__(self, hf_config: Any, ctx: ModelContext, prefix: str = "model",
                 make_mlp: MlpFactory | None = None, keep_embedding: bool = False) -> None:
        super().__init__()
        pp = get_pp_state()
        self.is_first_stage, self.is_last_stage = pp.is_first, pp.is_last
        # (the last stage keeps it too when the LM head is tied to it: keep_embedding)
        self.embed_tokens = (ctx.layer(VocabParallelEmbedding)(hf_config.vocab_size, hf_config.hidden_size, ctx)
                             if pp.is_first or (keep_embedding and pp.is_last) else PPMissingLayer())
        rotary = get_rope(hf_config, head_size_of(hf_config), ctx)  # one table shared by every layer
        windows = layer_sliding_windows(hf_config)
        self.start_layer, self.end_layer, self.layers = make_layers(
            hf_config.num_hidden_layers,
            lambda i, name: LlamaDecoderLayer(hf_config, ctx, rotary, windows[i], name,
                                              make_mlp(i, f"{name}.mlp") if make_mlp else None),
            prefix,
        )
        self.norm = ctx.layer(RMSNorm)(hf_config.hidden_size, hf_config.rms_norm_eps, ctx) if pp.is_last else PPMissingLayer()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        """``inputs_embeds`` [T, H] (first stage): used instead of embedding ``input_ids`` (a multimodal
        model's text embeddings with its image features spliced in); None: embed ``input_ids``."""
        if self.is_first_stage:
            hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [T, H]
            residual = None
        else:
            hidden, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden, residual = layer(positions, hidden, residual)
        if not self.is_last_stage:
            return {"hidden_states": hidden, "residual": residual}
        hidden, _ = self.norm(hidden, residual)
        return hidden


def flat_forward_step(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """``model``'s step through its ``LlamaFlatForward`` (the same kernels without the module tree, bit-identical),
    or None: the module path runs it (that class's docstring says where; ``HALSERVE_FLAT_FORWARD=0``: always).
    A function, not a method: decoders that borrow ``LlamaForCausalLM.forward`` (Gemma's) call it too, and
    are refused by ``why_not``."""
    flat = model.__dict__.get("_flat")
    if flat is None:
        from halserve.forward_context import get_forward_context

        if get_forward_context().attn_metadata is None:
            return None  # a dummy run: build at the first real step (the runner has bound the caches)
        from halserve.models.llama_flat import LlamaFlatForward

        why = LlamaFlatForward.why_not(model, model.__dict__.get("_platform_name", ""))
        model._flat = flat = why if why is not None else LlamaFlatForward(model)
        logger.debug("%s: %s", type(model).__name__, f"the module path ({why})" if why else "the flat forward")
    if isinstance(flat, str):
        return None
    return flat(input_ids, positions)


class LlamaForCausalLM(nn.Module):
    """The model-module protocol the model runner relies on:

    forward(input_ids [T], positions [T], intermediate_tensors=None, inputs_embeds=None) -> hidden [T, H]
        (before the last pipeline stage: IntermediateTensors; after the first, it reads them)
    compute_logits(hidden [N, H]) -> float32 [N, vocab]
    attention_layers -> list[Attention] in layer order (this pipeline stage's)
    load_weights(iterable of (HF name, tensor)) -> set of loaded parameter names
    supports_pipeline_parallel -> bool (class attribute)
    """

    supports_pipeline_parallel = True

    # HF checkpoint name fragment -> (our fused parameter fragment, shard id)
    STACKED_PARAMS = [
        (".q_proj", ".qkv_proj", "q"),
        (".k_proj", ".qkv_proj", "k"),
        (".v_proj", ".qkv_proj", "v"),
        (".gate_proj", ".gate_up_proj", 0),
        (".up_proj", ".gate_up_proj", 1),
    ]

    def __init__(self, hf_config: Any, ctx: ModelContext, make_mlp: MlpFactory | None = None) -> None:
        super().__init__()
        self.config = hf_config
        self._platform_name = ctx.platform_name
        # the flat forward (models/llama_flat.py), built at the first step with attention metadata; a str: why
        # this model keeps the module path (None: not built yet)
        self._flat: Any = None
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = LlamaModel(hf_config, ctx, make_mlp=make_mlp, keep_embedding=self.tie_word_embeddings)
        self.lm_head = (ctx.layer(ParallelLMHead)(hf_config.vocab_size, hf_config.hidden_size, ctx,
                                       tie_to=self.model.embed_tokens if self.tie_word_embeddings else None)
                        if get_pp_state().is_last else PPMissingLayer())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        if inputs_embeds is None and intermediate_tensors is None:
            hidden = flat_forward_step(self, input_ids, positions)
            if hidden is not None:
                return hidden
        if inputs_embeds is None:  # (decoders that share this method, e.g. Gemma's, take no inputs_embeds)
            return self.model(input_ids, positions, intermediate_tensors)
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    @property
    def attention_layers(self) -> list[Attention]:
        model = self.model
        return [layer.self_attn.attn for layer in islice(model.layers, model.start_layer, model.end_layer)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or "rotary_emb.sin_cached" in name:
                continue
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue  # the same tensor as embed_tokens (some checkpoints store both)
            if is_other_stage_weight(name, self):
                continue  # (pipeline parallelism: another stage loads it)
            for hf_part, our_part, shard_id in self.STACKED_PARAMS:  # noqa: B007 (shard_id: read after the break)
                if hf_part in name:
                    target = name.replace(hf_part, our_part)
                    break
            else:
                target, shard_id = name, None
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter ({target!r}) in "
                                 f"{type(self).__name__}; is this checkpoint for a different architecture?")
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor, shard_id) if shard_id is not None else loader(param, tensor)
            else:
                if param.shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(param.shape)}")
                param.data.copy_(tensor)
            loaded.add(target)
        if self.tie_word_embeddings and "lm_head.weight" in params:
            loaded.add("lm_head.weight")
        return loaded
