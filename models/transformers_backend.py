"""The Transformers modeling backend: transformers' own decoder code behind halserve's engine.

``--model-impl transformers`` (or ``auto`` for an architecture with no native code) builds the
checkpoint's transformers base model (``AutoModel.from_config``) with ``attn_implementation``
set to ``"halserve"``, a function registered in transformers' ``AttentionInterface``. Each
attention module of the model then hands its post-rotary q/k/v to one halserve ``Attention``
layer, so the selected attention backend writes the engine's paged KV cache and attends over
the flattened batch of the step (chunked prefills, prefix-cache hits and decodes together)::

    engine step: input_ids [T], positions [T]
        -> HF base model (input_ids [1, T], position_ids [1, T]; embeddings, rotary, norms, MLPs: its own)
           -> each attention module: q [1, Hq, T, D], k/v [1, Hk, T, D]
              -> halserve_attention -> Attention(q [T, Hq*D], k/v [T, Hk*D]) -> [1, T, Hq, D]
        -> hidden [T, H] -> halserve's ParallelLMHead -> float32 logits -> halserve's sampler

transformers builds no attention mask for an implementation it does not know, so none is made.

The token embedding is replaced by halserve's ``VocabParallelEmbedding`` (the LM head can be tied
to it); parameters are created on the meta device, then materialized on the platform's device in
the model dtype and filled from the checkpoint by ``load_weights``. What this backend cannot run
is refused at load with the reason (``check_config`` from the config alone, ``_attach_attention``
once the model is built): models with no attention or with non-attention (recurrent) layers,
non-causal attention, attention sinks, MLA, encoder-decoders and multimodal models. Sliding-window
layers (``layer_types``) get halserve's sliding KV-cache groups; the window transformers passes each
call is checked against them.

Tensor parallelism follows the config's ``base_model_tp_plan``: each ``nn.Linear`` an entry names becomes
halserve's ``ColumnParallelLinear`` (``colwise``; ``colwise_gather_output`` all-gathers) or
``RowParallelLinear`` (``rowwise``; ``rowwise_split_input`` slices a whole input), under the same parameter
names; an attention module whose q/k/v stay sharded gets an ``Attention`` over its rank's heads. A plan
entry with no such layer is refused by name. On one rank every ``nn.Linear`` becomes halserve's linear layer
all the same, so the GEMMs run on the platform's kernel (CPU: oneDNN's prepacked weights; BENCHMARKS.md).
Because those layers are halserve's, built under the checkpoint's names, the checkpoint's quant method
(GPTQ, AWQ, fp8, compressed-tensors: ``quant_methods/``) creates and loads their weights, and LoRA
adapters wrap them (``halserve.lora``; an adapter's module names are the checkpoint's).

Pipeline parallelism cuts transformers' layer loop (configs with a ``base_model_pp_plan``;
``split_pipeline_stage``): another stage's layers hand the hidden states through, the one just before
this stage's first returns what the previous stage sent, and the embedding / final norm / LM head exist
only on the stages that use them::

    stage 0: embed -> layers[0:k] -> (pass-through ...) -> hidden [T, H] sent on
    stage 1: zeros -> (pass-through ...) -> stand-in of layers[k-1]: the received hidden -> layers[k:n] -> norm -> head

``*ForSequenceClassification`` checkpoints build ``TransformersForSequenceClassification`` (the base model
and a ``score`` head, served by the pooling runner: ``/classify``); every decoder's final hidden states
serve embeddings as a native model's do.
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from halserve.distributed import get_pp_state
from halserve.layers import Attention, ModelContext, ParallelLMHead, VocabParallelEmbedding
from halserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from halserve.models.interfaces import CLASSIFIER_SUFFIX
from halserve.models.pipeline import IntermediateTensors, PPMissingLayer, is_other_stage_weight, stage_layer_range
from halserve.models.sequence_classification import ClassifierHead

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "halserve"  # the name registered in transformers' AttentionInterface
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# config attributes that describe layers other than attention (state-space / recurrent mixers)
RECURRENT_CONFIG_KEYS = ("layers_block_type", "hybrid_override_pattern", "attn_layer_indices", "ssm_cfg",
                         "mamba_d_state", "state_size", "linear_attn_config", "block_types")
# module class name fragments of recurrent mixers, for models that name no layer types in their config
RECURRENT_MODULE_NAMES = ("Mamba", "Mixer", "SSM", "GatedDeltaNet", "LinearAttention", "Rwkv", "RWKV",
                          "Recurrent", "ShortConv", "Lightning")


# base_model_tp_plan styles -> (halserve layer, its flag): "column" is ColumnParallelLinear (flag: all-gather
# the output), "row" is RowParallelLinear (flag: the input arrives whole, each rank takes its slice)
TP_STYLES = {"colwise": ("column", False), "colwise_gather_output": ("column", True),
             "rowwise": ("row", False), "rowwise_split_input": ("row", True)}
REPLICATED_STYLES = ("replicated_with_grad_allreduce",)  # (whole on every rank: nothing to do for inference)


class TransformersBackendError(ValueError):
    """A model the Transformers backend cannot serve; the message names the reason."""


# -- what it can run ---------------------------------------------------------------------------
def check_config(config: Any, hf_config: Any, architecture: str) -> None:
    """Refuse (``TransformersBackendError``) what the backend cannot run, from the engine config and
    the checkpoint's config alone (no weights). Called by ``get_model_info`` before any rank starts."""
    import transformers

    def refuse(reason: str) -> None:
        raise TransformersBackendError(
            f"{architecture} cannot run on the Transformers modeling backend (--model-impl transformers): {reason}")

    cls = getattr(transformers, architecture, None)
    auto_map = getattr(hf_config, "auto_map", None) or {}
    if cls is None and not (config.trust_remote_code and "AutoModel" in auto_map):
        refuse(f"transformers {transformers.__version__} has no class {architecture!r}"
               + (" (the checkpoint ships its own code: pass trust_remote_code)" if auto_map else
                  "; upgrade transformers (pip install -U transformers)"))
    if not architecture.endswith(("ForCausalLM", CLASSIFIER_SUFFIX)):
        refuse(f"it serves decoder language models (*ForCausalLM, embeddings from their final hidden states) and "
               f"*{CLASSIFIER_SUFFIX} heads only; other heads (vision-language, token classification, ...) are "
               "not wired to it")
    if architecture.endswith(CLASSIFIER_SUFFIX):
        num_labels = getattr(hf_config, "num_labels", 0)
        if not isinstance(num_labels, int) or num_labels < 1:
            refuse(f"a sequence classifier needs num_labels >= 1 in its config.json, got {num_labels!r}")
    if getattr(hf_config, "is_encoder_decoder", False):
        refuse("it is an encoder-decoder model (cross-attention has no paged KV cache here)")
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if text_config is not hf_config:
        refuse("it is a multimodal model (its decoder sits in a text_config)")
    other = sorted({t for t in getattr(text_config, "layer_types", None) or [] if t not in ATTENTION_LAYER_TYPES})
    if other:
        refuse(f"its config lists layer types {other} besides attention (recurrent / linear-attention "
               "layers keep a state the paged KV cache does not hold)")
    markers = [k for k in RECURRENT_CONFIG_KEYS if getattr(text_config, k, None) is not None]
    if markers:
        refuse(f"its config describes non-attention (recurrent) layers ({', '.join(markers)})")
    if cls is not None and not getattr(cls, "_supports_attention_backend", False):
        refuse(f"its transformers implementation ({cls.__name__}) does not route attention through "
               "transformers' AttentionInterface (_supports_attention_backend is False), so halserve's "
               "paged attention cannot be plugged in")
    if getattr(text_config, "kv_lora_rank", None) is not None:
        refuse("it uses multi-head latent attention (kv_lora_rank), which the attention interface passes "
               "as full heads the KV cache is not sized for")
    if config.pipeline_parallel_size > 1 and not getattr(text_config, "base_model_pp_plan", None):
        refuse(f"its config has no base_model_pp_plan (the embedding / layers / norm split transformers declares), "
               f"so there is no pipeline layout for pipeline_parallel_size={config.pipeline_parallel_size}; use "
               "pipeline_parallel_size=1 (tensor_parallel_size shards it instead)")
    if config.tensor_parallel_size > 1:
        plan = tp_plan(text_config)
        if not plan:
            refuse(f"its config has no base_model_tp_plan, so there is no tensor-parallel layout for "
                   f"tensor_parallel_size={config.tensor_parallel_size}; use tensor_parallel_size=1")
        unknown = {pattern: style for pattern, style in plan.items()
                   if style not in TP_STYLES and style not in REPLICATED_STYLES}
        if unknown:
            pattern, style = next(iter(unknown.items()))
            refuse(f"its base_model_tp_plan entry {pattern!r}: {style!r} has no halserve parallel layer (mapped: "
                   f"{', '.join(sorted(TP_STYLES) + sorted(REPLICATED_STYLES))}); use tensor_parallel_size=1")


def tp_plan(text_config: Any) -> dict[str, str]:
    """The decoder's ``base_model_tp_plan`` (module name pattern, ``*`` a layer index -> style); {} if none."""
    return dict(getattr(text_config, "base_model_tp_plan", None) or {})


def _plan_style(plan: dict[str, str], name: str) -> tuple[str, str] | None:
    """(pattern, style) of the plan entry naming module ``name`` (``layers.3.mlp.up_proj``), or None."""
    import re

    for pattern, style in plan.items():
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name):
            return pattern, style
    return None


def backend_status() -> dict[str, Any]:
    """For ``halserve plugins``: whether the backend can run here (transformers installed), without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("transformers")
    except PackageNotFoundError:
        found = None
    return {
        "available": found is not None,
        "transformers_version": found,
        "serves": "any *ForCausalLM transformers implements with AttentionInterface support, for architectures "
                  "not registered above (--model-impl auto) or all (--model-impl transformers)",
        "reason": None if found is not None else "transformers is not installed (pip install transformers)",
    }


# -- attention: transformers' interface -> halserve's Attention layer ---------------------------
def halserve_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers calls this in every attention module (``attn_implementation="halserve"``).

    query [1, Hq, T, D], key/value [1, Hk, T, D] (after rotary) -> ([1, T, Hq, D], no weights).
    The module's halserve ``Attention`` (set by ``TransformersForCausalLM``) writes K/V into the
    paged cache and attends with the step's metadata (the forward context)."""
    attn: Attention | None = getattr(module, "halserve_attn", None)
    if attn is None:
        raise RuntimeError(f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) has no halserve "
                           "attention layer; build the model through halserve.models.transformers_backend")
    if scaling is not None and scaling != attn.scale:
        raise RuntimeError(f"{attn.prefix}: transformers asks for attention scaling {scaling}, the layer was "
                           f"built with {attn.scale}")
    if "sliding_window" in kwargs and kwargs["sliding_window"] != attn.sliding_window:
        raise RuntimeError(f"{attn.prefix}: transformers asks for a sliding window of {kwargs['sliding_window']} "
                           f"tokens, the layer's KV cache was built for {attn.sliding_window} (from the config's "
                           "layer_types / sliding_window)")
    num_tokens = query.shape[2]
    q = query[0].transpose(0, 1).reshape(num_tokens, -1)  # [T, Hq * D]
    k = key[0].transpose(0, 1).reshape(num_tokens, -1)  # [T, Hk * D]
    v = value[0].transpose(0, 1).reshape(num_tokens, -1)
    out = attn(q, k, v)  # [T, Hq * D]
    return out.view(1, num_tokens, attn.num_heads, attn.head_size), None


def register_attention() -> None:
    """Register ``halserve_attention`` in transformers' global ``AttentionInterface`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, halserve_attention)


def _module_window(module: nn.Module) -> int | None:
    """The window a transformers attention module slides over (None: full attention). EXAONE 4 keeps the
    config's window on every module and says which slide in ``is_sliding``."""
    window = getattr(module, "sliding_window", None)
    if getattr(module, "is_sliding", True) is False:
        return None
    return window


# -- building ---------------------------------------------------------------------------------
@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters go to the meta device as modules register them (no memory, no init); buffers
    (rotary frequencies, ...) stay where they are computed, on the current default device."""
    from transformers.initialization import no_init_weights

    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        with no_init_weights():
            yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


class _ScaledEmbedding(VocabParallelEmbedding):
    """``VocabParallelEmbedding`` times the scale the replaced embedding applied (Gemma 3's)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: ModelContext, scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim, ctx)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.scale


class _HFColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` for transformers' module code: any leading dims ([1, T, in] -> [1, T, out])."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x.reshape(-1, x.shape[-1]))
        return y.view(*x.shape[:-1], y.shape[-1])


class _HFRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` for transformers' module code; ``split_input``: x arrives whole (the column layer
    before it gathered its output) and each rank multiplies its own slice of it."""

    def __init__(self, *args: Any, split_input: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.split_input = split_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_input:
            x = x.narrow(-1, self.tp_rank * self.input_size_per_partition, self.input_size_per_partition)
        y = super().forward(x.reshape(-1, x.shape[-1]))
        return y.view(*x.shape[:-1], y.shape[-1])


class _PPPassThrough(PPMissingLayer):
    """Another pipeline stage's decoder layer, inside transformers' layer loop: hands the hidden states on."""

    def forward(self, input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return input  # (transformers' loop passes the hidden states first, then its keyword arguments)


class _PPStageInput(PPMissingLayer):
    """The other stage's layer just before this stage's first: returns what the previous stage sent
    (``hidden`` [1, T, H], set by ``forward`` each step) in place of what the loop computed so far."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.hidden is not None, "a pipeline stage after the first runs on its received hidden states"
        return self.hidden


class _PPZeroEmbedding(PPMissingLayer):
    """The token embedding on a stage after the first: zeros [1, T, H] in the model dtype, so whatever the
    model does to its embeddings before the layers (Granite's multiplier, the rotary table's dtype) runs on
    something of the right shape; ``_PPStageInput`` replaces it before this stage's first layer."""

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden_size, self.dtype = hidden_size, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*input_ids.shape, self.hidden_size, dtype=self.dtype, device=input_ids.device)


def split_pipeline_stage(model: nn.Module, num_layers: int) -> tuple[int, int, _PPStageInput | None]:
    """This pipeline stage's layers ``[start, end)`` of ``model.layers`` (the transformers base model's);
    the others become ``_PPPassThrough`` (the one before ``start``: ``_PPStageInput``, returned), the final
    norm ``PPMissingLayer`` before the last stage. ``start_layer`` / ``end_layer`` are set on ``model`` for
    ``is_other_stage_weight``. The embedding is the caller's (it may be tied to the LM head)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) != num_layers or not hasattr(model, "norm"):
        raise TransformersBackendError(
            f"{type(model).__name__} has no layers list of its {num_layers} decoder layers and a final norm "
            "(model.layers / model.norm), so it cannot be cut into pipeline stages; use pipeline_parallel_size=1")
    start, end = stage_layer_range(num_layers)
    stage_input = _PPStageInput() if start > 0 else None
    for i in range(num_layers):
        if not start <= i < end:
            layers[i] = stage_input if stage_input is not None and i == start - 1 else _PPPassThrough()
    if not get_pp_state().is_last:
        model.norm = PPMissingLayer()
    model.__dict__.update(start_layer=start, end_layer=end)  # (plain attributes on the transformers module)
    return start, end, stage_input


def apply_tp_plan(model: nn.Module, plan: dict[str, str], ctx: ModelContext, prefix: str = "model") -> set[str]:
    """Replace each ``nn.Linear`` of ``model`` a ``base_model_tp_plan`` entry names with halserve's parallel
    layer (same parameter names, so the checkpoint loads unchanged); returns the names of the modules whose
    heads are split over the ranks (parents of a ``colwise`` layer whose output stays sharded)."""
    split_parents: set[str] = set()
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        entry = _plan_style(plan, name)
        if entry is None or entry[1] in REPLICATED_STYLES:
            continue
        kind, flag = TP_STYLES[entry[1]]
        bias = module.bias is not None
        layer: nn.Module
        if kind == "column":
            layer = _HFColumnParallelLinear(module.in_features, module.out_features, bias, ctx, f"{prefix}.{name}",
                                            gather_output=flag)
            if not flag:
                split_parents.add(name.rpartition(".")[0])
        else:
            layer = _HFRowParallelLinear(module.in_features, module.out_features, bias, ctx, f"{prefix}.{name}",
                                         split_input=flag)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    return split_parents


def use_platform_linears(model: nn.Module, ctx: ModelContext, prefix: str = "model") -> set[str]:
    """On one rank: every ``nn.Linear`` of ``model`` -> halserve's linear layer (the same parameter names),
    so its GEMMs run on the platform's kernel (CPU: oneDNN's prepacked weights) instead of ``F.linear``.
    Returns no split modules (one rank holds every head)."""
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear:
            layer = _HFColumnParallelLinear(module.in_features, module.out_features, module.bias is not None, ctx,
                                            f"{prefix}.{name}")
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, layer)
    return set()


class TransformersForCausalLM(nn.Module):
    """Any ``*ForCausalLM`` transformers implements, as a halserve ``TextGenerationModel``
    (``halserve.models.interfaces``): built as ``cls(hf_config, ctx)`` by the loader."""

    supports_pipeline_parallel = True  # (where the base model has a layers list: split_pipeline_stage)

    def __init__(self, hf_config: Any, ctx: ModelContext) -> None:
        super().__init__()
        from transformers import AutoModel

        register_attention()
        hf_config = copy.deepcopy(hf_config)  # (the attention implementation is set on it)
        self.config = hf_config
        device = torch.get_default_device()  # (the loader builds under the platform's device)
        hf_config._attn_implementation = ATTN_IMPLEMENTATION
        trust = bool(getattr(hf_config, "auto_map", None))
        with _parameters_on_meta():
            model = AutoModel.from_config(hf_config, dtype=ctx.dtype, attn_implementation=ATTN_IMPLEMENTATION,
                                          trust_remote_code=trust)
        self.model = model
        from halserve.distributed import get_tp_size

        pp = get_pp_state()
        self.is_first_stage, self.is_last_stage = pp.is_first, pp.is_last
        # (one stage: every layer; start/end also tell _attach_attention which layers this stage holds)
        num_layers = hf_config.num_hidden_layers
        stage: tuple[int, int, _PPStageInput | None] = (split_pipeline_stage(model, num_layers) if pp.size > 1
                                                        else (0, num_layers, None))
        self.start_layer, self.end_layer, self.stage_input = stage
        self.tp_size = get_tp_size()
        # attention modules whose heads the ranks split (their q/k/v stay sharded); none on one rank
        self.split_heads = (apply_tp_plan(model, tp_plan(hf_config), ctx) if self.tp_size > 1
                            else use_platform_linears(model, ctx))
        self.base_model_prefix = getattr(model, "base_model_prefix", "model") or "model"
        self.ignored_keys = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        vocab_size, hidden_size = hf_config.vocab_size, hf_config.hidden_size
        old = self.model.get_input_embeddings()
        scale = getattr(old, "embed_scale", None)
        embed: nn.Module
        if self.is_first_stage or (self.tie_word_embeddings and self.is_last_stage):
            embed = (_ScaledEmbedding(vocab_size, hidden_size, ctx, float(scale)) if scale is not None
                     else VocabParallelEmbedding(vocab_size, hidden_size, ctx))
        else:
            embed = _PPZeroEmbedding(hidden_size, ctx.dtype)
        self.model.set_input_embeddings(embed)
        self._build_head(ctx, embed)
        # what transformers' *ForCausalLM head does to the logits besides the projection
        self.logits_divisor = float(getattr(hf_config, "logits_scaling", None) or 1.0)  # Granite
        self.logit_scale = float(getattr(hf_config, "logit_scale", None) or 1.0)  # Cohere
        self.final_logit_softcap = getattr(hf_config, "final_logit_softcapping", None)  # Gemma 2/3
        self._materialize(device, ctx.dtype)
        self.layers = nn.ModuleList(self._attach_attention(ctx))

    def _build_head(self, ctx: ModelContext, embed: nn.Module) -> None:
        """The LM head (tied to ``embed`` when the config says so), on the last pipeline stage."""
        config = self.config
        self.lm_head: ParallelLMHead | PPMissingLayer = PPMissingLayer()
        if self.is_last_stage:
            tie_to = embed if self.tie_word_embeddings else None
            assert tie_to is None or isinstance(tie_to, VocabParallelEmbedding)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx, tie_to=tie_to)

    def _materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        """Every parameter still on the meta device -> an empty one on ``device`` (floats in ``dtype``)."""
        for module in self.model.modules():
            for name, param in list(module._parameters.items()):
                if param is None or param.device.type != "meta":
                    continue
                kind = dtype if param.dtype.is_floating_point else param.dtype
                module._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=kind, device=device),
                                                        requires_grad=False)

    def _attach_attention(self, ctx: ModelContext) -> list[Attention]:
        """One halserve ``Attention`` per transformers attention module, in layer order; refuses
        (``TransformersBackendError``) a model whose attention the interface cannot express."""
        from halserve.models.gemma import attention_logits_soft_cap
        from halserve.models.llama import head_size_of, layer_sliding_windows

        config = self.config
        arch = (getattr(config, "architectures", None) or [type(self.model).__name__])[0]

        def refuse(reason: str) -> None:
            raise TransformersBackendError(f"{arch} cannot run on the Transformers modeling backend: {reason}")

        num_layers = config.num_hidden_layers
        found: dict[int, tuple[str, nn.Module]] = {}
        recurrent = []
        for name, module in self.model.named_modules():
            kind = type(module).__name__
            if any(part in kind for part in RECURRENT_MODULE_NAMES) and not kind.endswith("Attention"):
                recurrent.append(f"{name} ({kind})")
            if kind.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int):
                if module.layer_idx in found:
                    refuse(f"layer {module.layer_idx} has two attention modules ({found[module.layer_idx][0]}, {name})")
                found[module.layer_idx] = (name, module)
        if recurrent:
            refuse(f"it has non-attention (recurrent) layers: {', '.join(recurrent[:3])}")
        stage = range(self.start_layer, self.end_layer)  # (this pipeline stage's layers)
        missing = [i for i in stage if i not in found]
        if missing:
            refuse(f"no attention module found for layers {missing[:8]} of {num_layers} (each decoder layer needs "
                   "one attention module with a layer_idx; recurrent or attention-free layers cannot run here)")
        head_size = head_size_of(config)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        windows = layer_sliding_windows(config)
        soft_cap = attention_logits_soft_cap(config)
        layers = []
        for i in stage:
            name, module = found[i]
            local_heads, local_kv_heads = num_heads, num_kv_heads
            if name in self.split_heads:  # (its q/k/v are colwise: each rank holds 1/tp of the heads)
                tp = self.tp_size
                if num_heads % tp or num_kv_heads % tp:
                    refuse(f"{name}'s {num_heads} heads / {num_kv_heads} KV heads do not split over "
                           f"tensor_parallel_size={tp} ranks as its base_model_tp_plan shards q/k/v (colwise); use a "
                           "tensor_parallel_size that divides both")
                local_heads, local_kv_heads = num_heads // tp, num_kv_heads // tp
            if getattr(module, "is_causal", True) is not True:
                refuse(f"{name} is not causal (bidirectional attention has no paged decode)")
            if "sinks" in module._parameters or hasattr(module, "sinks"):
                refuse(f"{name} has attention sinks, which the attention interface cannot express")
            module_head = getattr(module, "head_dim", head_size)
            if module_head != head_size:
                refuse(f"{name} has head_dim {module_head}, the config {head_size}")
            window = _module_window(module)
            if window != windows[i]:
                refuse(f"{name} slides over {window} tokens where the config says {windows[i]}; this sliding-"
                       "window pattern is not one halserve's KV cache manager reads from the config")
            scale = getattr(module, "scaling", None)
            attn = Attention(local_heads, head_size, float(scale) if scale is not None else head_size**-0.5,
                             local_kv_heads, ctx, sliding_window=window, logits_soft_cap=soft_cap,
                             prefix=f"model.{name}.attn")
            attn.scale = float(scale) if scale is not None else head_size**-0.5  # type: ignore[assignment]
            module.__dict__["halserve_attn"] = attn  # (a plain attribute: self.layers owns it)
            layers.append(attn)
        return layers

    # -- TextGenerationModel ------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        """input_ids [T], positions [T] -> final hidden states [T, H] (a batch of one, T tokens long).
        Pipeline stages: after the first, the previous stage's hidden states enter before this stage's first
        layer (``_PPStageInput``); before the last, this stage's last layer's output is sent on."""
        if self.stage_input is not None:
            assert intermediate_tensors is not None, "a stage after the first needs the previous stage's output"
            self.stage_input.hidden = intermediate_tensors["hidden_states"][None]  # [1, T, H]
        if inputs_embeds is not None:
            out = self.model(inputs_embeds=inputs_embeds[None], position_ids=positions[None], use_cache=False)
        else:
            out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        hidden = out[0][0]  # [T, H]
        if not self.is_last_stage:  # (transformers' layers add their own residual: the runner's slot is unused)
            return {"hidden_states": hidden, "residual": torch.zeros_like(hidden)}
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert isinstance(self.lm_head, ParallelLMHead), "only the last pipeline stage computes logits"
        logits = self.lm_head.compute_logits(hidden)  # [N, vocab] float32
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.logits_divisor != 1.0:
            logits = logits / self.logits_divisor
        if self.final_logit_softcap:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer for layer in self.layers if isinstance(layer, Attention)]

    def _target(self, name: str) -> str | None:
        """A checkpoint name -> this module's parameter name; None for a tensor to skip."""
        import re

        if any(re.search(pattern, name) for pattern in self.ignored_keys):
            return None
        if "rotary_emb." in name:  # (buffers some checkpoints store)
            return None
        if name.startswith("lm_head."):
            return None if self.tie_word_embeddings else name
        prefix = self.base_model_prefix
        if prefix != "model" and name.startswith(prefix + "."):
            return "model." + name[len(prefix) + 1:]
        if not name.startswith("model."):  # (a checkpoint of the bare base model)
            return "model." + name
        return name

    def map_checkpoint_name(self, name: str) -> str:
        """A checkpoint module name -> ours (``transformer.h.0.attn`` of a base model prefixed ``transformer``
        -> ``model.h.0.attn``): read by the LoRA manager for an adapter's module names."""
        prefix = self.base_model_prefix
        return "model." + name[len(prefix) + 1:] if prefix != "model" and name.startswith(prefix + ".") else name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._target(name)
            if target is None:
                continue
            if is_other_stage_weight(target, self):
                continue
            param = params.get(target)
            if param is None and getattr(self.config, "quantization_config", None) is not None:
                raise TransformersBackendError(
                    f"quantized checkpoint tensor {name!r} has no matching parameter ({target!r}) in "
                    f"{type(self.model).__name__}: the Transformers backend quantizes only the nn.Linear layers it "
                    "turns into halserve's (every one on one rank; those base_model_tp_plan names under tensor "
                    "parallelism), under the checkpoint's names")
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter ({target!r}) in "
                                 f"{type(self.model).__name__}; is this checkpoint for a different architecture?")
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor)
            else:
                if param.shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(param.shape)}")
                param.data.copy_(tensor)
            loaded.add(target)
        if self.tie_word_embeddings and "lm_head.weight" in params:
            loaded.add("lm_head.weight")
        return loaded


class TransformersForSequenceClassification(ClassifierHead, TransformersForCausalLM):
    """Any ``*ForSequenceClassification`` (and reward model) whose decoder transformers implements: the
    base model as above, then transformers' ``score`` head on the pooled last token, with the model-module
    protocol of ``halserve.models.sequence_classification`` (``classify`` / ``activate``, no LM head)::

        hidden = base model (paged attention)       [T, H]
        pooled = hidden[last prompt token]          [N, H]   the model runner's pooler (LAST)
        logits = pooled @ score.weight.T            [N, num_labels]  float32
    """

    def _build_head(self, ctx: ModelContext, embed: nn.Module) -> None:
        self.tie_word_embeddings = False  # (a classifier checkpoint has no lm_head to tie)
        self.build_score_head(self.config, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a sequence classifier has no LM head; the runner calls classify()")

    def _target(self, name: str) -> str | None:
        if name.startswith("score."):
            return name
        return super()._target(name)


def transformers_model_class(architecture: str) -> type[TransformersForCausalLM]:
    """The backend's model module for a checkpoint architecture (what the loader builds)."""
    if architecture.endswith(CLASSIFIER_SUFFIX):
        return TransformersForSequenceClassification
    return TransformersForCausalLM
