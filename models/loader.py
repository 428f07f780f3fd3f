"""From a model name to a loaded ``nn.Module``.

    resolve_model_path(model)     local dir as is, else a hub snapshot (config, weights, tokenizer)
    get_model_info(config, plat)  cheap: config files only -> ModelInfo (sizes, dtype, eos, ...)
    load_model(config, info, ...) build the architecture on the device, stream safetensors in
                                  (or, load_format "dummy", fill random weights there)
    a GGUF file (or a folder holding one) is read through halserve.models.gguf, dequantized at load
"""
from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from halserve.attention_backends.base import kv_cache_torch_dtype
from halserve.models.interfaces import (
    CLASSIFIER_SUFFIX,
    ModelModule,
    supports_multimodal,
    supports_pipeline_parallel,
    uses_mrope,
)
from halserve.models.model_path import check_local_path
from halserve.pooler_config import resolve_pooler_config
from halserve.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.platforms.base import Platform

logger = logging.getLogger(__name__)

HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "tokenizer*", "*.jinja"]
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                           "presence_penalty", "frequency_penalty", "max_new_tokens", "do_sample")
PROGRESS_BAR_MIN_BYTES = 1 << 30  # show a progress bar past ~1 GB or more than one shard


@dataclass
class ModelInfo:
    """What the engine needs to know about a checkpoint before building it."""

    architecture: str  # HF architectures[0], e.g. "LlamaForCausalLM"
    hf_config: Any  # transformers PretrainedConfig
    model_path: str  # local directory
    dtype: torch.dtype  # resolved model dtype
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int  # total (not per rank)
    num_kv_heads: int  # total (not per rank)
    head_size: int
    max_model_len: int
    sliding_window: int | None  # the largest window of any layer; None if every layer is full
    logits_soft_cap: float | None = None  # cap * tanh(score / cap) on attention scores (Gemma 2); None: off
    eos_token_ids: list[int] = field(default_factory=list)
    generation_defaults: dict[str, Any] = field(default_factory=dict)  # from generation_config.json
    max_logprobs: int = MAX_LOGPROBS  # most logprobs/prompt_logprobs a request may ask for (config.max_logprobs)
    kv_cache_bytes_per_token: int = 0  # K and V of every layer, all ranks together
    pooler_config: Any = None  # PoolerConfig, both fields set: the embedding defaults (halserve.pooler_config)
    # "generate": an LM head (generate, embed); "pooling": a classifier (*ForSequenceClassification,
    # no LM head), whose requests only classify (halserve.pooling_params.check_task)
    runner: str = "generate"
    num_labels: int | None = None  # a classifier's number of classes; None for a generative model
    id2label: dict[int, str] = field(default_factory=dict)  # a classifier's class index -> label
    # a vision-language model (its class's supports_multimodal): the image placeholder token
    # (halserve.multimodal.processing); None for a text-only model
    image_token_id: int | None = None
    uses_mrope: bool = False  # its positions are M-RoPE's three axes (Qwen2-VL): [3, T] with images
    max_images_per_prompt: int = 0  # a vision-language model's limit (limit_mm_per_prompt); 0 for a text model
    image_processor_kwargs: dict[str, Any] = field(default_factory=dict)  # mm_processor_kwargs
    # a GGUF checkpoint (halserve.models.gguf): its first file; model_path is then its folder. None: safetensors
    gguf_file: str | None = None
    # which code runs it: "halserve" (its registered native class) or "transformers" (transformers' modeling
    # code with halserve's paged attention: halserve.models.transformers_backend); EngineConfig.model_impl
    model_impl: str = "halserve"

    @property
    def is_multimodal(self) -> bool:
        return self.image_token_id is not None


def resolve_model_path(model: str, revision: str | None = None) -> str:
    """A local directory for ``model``: itself if it is one, else a Hugging Face snapshot. A model that
    looks like a local path and does not exist: ``ModelPathNotFoundError`` (no hub lookup)."""
    if os.path.isdir(model):
        return model
    check_local_path(model)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS)
    except Exception as exc:  # offline, unknown id, no access ...
        raise ValueError(
            f"model {model!r} is neither a local directory nor downloadable from the Hugging Face hub "
            f"({type(exc).__name__}: {exc}). For offline use pass the path of a directory holding "
            "config.json and *.safetensors, or download it first (huggingface-cli download) and set "
            "HF_HUB_OFFLINE=1 so the cached snapshot is used."
        ) from exc


def generation_defaults(config: EngineConfig, checkpoint_gen: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults ``config.generation_config`` names (vLLM's ``--generation-config``):
    ``auto`` the checkpoint's generation_config.json, ``vllm`` none, a folder its generation_config.json."""
    source = getattr(config, "generation_config", "auto")
    if source == "vllm":
        return {}
    gen = checkpoint_gen
    if source != "auto":
        gen = _read_json(os.path.join(os.path.expanduser(source), "generation_config.json"))
    return {k: gen[k] for k in GENERATION_DEFAULT_KEYS if k in gen}


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float": torch.float32, "half": torch.float16}


def resolve_dtype(requested: str, hf_config: Any, platform: Platform | type[Platform]) -> torch.dtype:
    """``auto`` -> the checkpoint's dtype if the platform supports it, else the platform default."""
    if requested != "auto":
        return _DTYPE_NAMES[requested]
    checkpoint = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(checkpoint).replace("torch.", "") if checkpoint is not None else None
    name = {"float": "float32", "half": "float16"}.get(name or "", name)
    chosen, reason = platform.auto_dtype(name if name in _DTYPE_NAMES else None)
    logger.info("dtype auto -> %s on %s (%s)", chosen, platform.name, reason)
    return _DTYPE_NAMES[chosen]


def gguf_kv_cache_default(config: EngineConfig, info: ModelInfo, platform: Platform) -> str | None:
    """``"float16"`` where a GGUF checkpoint computed in float32 should keep a float16 KV cache, else None.

    llama.cpp keeps its cache in f16 by default (``-ctk f16``), and halserve's GGUF path computes in float32: a
    float32 cache doubles the bytes each decode step's attention reads (at 64 streams of SmolLM2 the largest part
    of a step, BENCHMARKS.md "A bfloat16 KV cache"). So ``kv_cache_dtype="auto"`` means float16 for such a model
    whose blocks stay quantized (its answers are already llama.cpp-like arithmetic; dequantized at load with
    ``quantization="unquantized"`` it computes in floats throughout), where the attention backend it gets takes a
    float16 cache; an explicit setting is kept (``float32`` keeps the float32 cache)."""
    import copy

    from halserve.worker.backend_selection import select_attention_backend

    if (config.kv_cache_dtype != "auto" or info.gguf_file is None or info.dtype != torch.float32
            or config.quantization == "unquantized"):
        return None
    trial = copy.copy(config)
    trial.kv_cache_dtype = "float16"
    try:  # (the same backend as with "auto", never a slower one picked for the cache's sake)
        if select_attention_backend(trial, platform, info) is not select_attention_backend(config, platform, info):
            return None
    except ValueError:
        return None
    return "float16"


def with_kv_cache_dtype(info: ModelInfo, old: str, new: str) -> ModelInfo:
    """``info`` for a KV cache of ``new`` instead of ``old`` (its bytes per token rescaled)."""
    before, after = (kv_cache_torch_dtype(name, info.dtype).itemsize for name in (old, new))
    return dataclasses.replace(info, kv_cache_bytes_per_token=info.kv_cache_bytes_per_token * after // before)


def supported_architectures() -> dict[str, str | type]:
    from halserve.models import supported_architectures

    return supported_architectures()


def get_model_info(config: EngineConfig, platform: Platform) -> ModelInfo:
    """Read the checkpoint's config files (no weights) and validate them against ``config``."""
    from transformers import AutoConfig

    from halserve.models.gemma import attention_logits_soft_cap
    from halserve.models.gguf import check_tokenizer_metadata, find_gguf_file, load_gguf_config
    from halserve.models.llama import head_size_of, layer_sliding_windows

    check_local_path(config.model)  # (a missing local path: "no such file or directory", not a hub error)
    for what, value in (("--tokenizer", config.tokenizer), ("--hf-config-path", config.hf_config_path)):
        if value is not None:
            check_local_path(value, what)
    gguf_file = find_gguf_file(config.model)  # a GGUF checkpoint (its first shard), else None
    if gguf_file is not None:
        path = os.path.dirname(os.path.abspath(gguf_file))
        hf_config = load_gguf_config(gguf_file, config.hf_config_path, config.trust_remote_code)
        if config.tokenizer is None:  # (its tokenizer is built after the weights load: check it can be, first)
            check_tokenizer_metadata(gguf_file)
    else:
        path = resolve_model_path(config.model, config.revision)
        hf_config = AutoConfig.from_pretrained(config.hf_config_path or path, trust_remote_code=config.trust_remote_code)
    arch, model_impl = resolve_model_impl(config, hf_config)
    # A multimodal checkpoint nests its decoder's sizes in text_config (transformers' get_text_config)
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    model_max = getattr(text_config, "max_position_embeddings", None)
    if config.max_model_len is None:
        if model_max is None:
            raise ValueError(f"{config.model!r} does not declare max_position_embeddings; set max_model_len")
        max_model_len = model_max
    elif model_max is not None and config.max_model_len > model_max:
        raise ValueError(
            f"max_model_len {config.max_model_len} is larger than the model's max_position_embeddings "
            f"{model_max}; use max_model_len <= {model_max}"
        )
    else:
        max_model_len = config.max_model_len
    dtype = resolve_dtype(config.dtype, hf_config, platform)
    num_heads = text_config.num_attention_heads
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    head_size = head_size_of(text_config)
    _check_tensor_parallel(config.tensor_parallel_size, num_heads, num_kv_heads, text_config)
    if config.pipeline_parallel_size > 1:
        _check_pipeline_parallel(config.pipeline_parallel_size, arch, text_config, model_impl)
    windows = [w for w in layer_sliding_windows(text_config) if w is not None]
    gen = _read_json(os.path.join(path, "generation_config.json"))
    eos = (_as_list(gen.get("eos_token_id")) or _as_list(getattr(hf_config, "eos_token_id", None))
           or _as_list(getattr(text_config, "eos_token_id", None)))
    pooler_config = resolve_pooler_config(path, config.pooler_config)
    is_classifier = arch.endswith(CLASSIFIER_SUFFIX)
    id2label = getattr(hf_config, "id2label", None) or {}
    model_cls = _transformers_class(arch) if model_impl == "transformers" else model_class(arch, platform.name)
    multimodal = supports_multimodal(model_cls)
    elem_size = kv_cache_torch_dtype(config.kv_cache_dtype, dtype).itemsize  # (every fp8 flavour: 1)
    return ModelInfo(
        architecture=arch,
        hf_config=hf_config,
        model_path=path,
        dtype=dtype,
        vocab_size=text_config.vocab_size,
        hidden_size=text_config.hidden_size,
        num_layers=text_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        max_model_len=max_model_len,
        sliding_window=max(windows) if windows else None,
        logits_soft_cap=attention_logits_soft_cap(text_config),
        eos_token_ids=eos,
        generation_defaults=generation_defaults(config, gen),
        max_logprobs=getattr(config, "max_logprobs", MAX_LOGPROBS),
        kv_cache_bytes_per_token=_kv_cache_bytes_per_token(text_config, model_impl, num_kv_heads, head_size,
                                                           elem_size, config.tensor_parallel_size),
        pooler_config=pooler_config,
        runner="pooling" if is_classifier else "generate",
        num_labels=hf_config.num_labels if is_classifier else None,
        id2label={int(k): str(v) for k, v in id2label.items()} if is_classifier else {},
        image_token_id=model_cls.image_token_id(hf_config) if multimodal else None,
        uses_mrope=uses_mrope(model_cls),
        max_images_per_prompt=_max_images(config) if multimodal else 0,
        image_processor_kwargs=dict(config.mm_processor_kwargs or {}) if multimodal else {},
        gguf_file=gguf_file,
        model_impl=model_impl,
    )


def _kv_cache_bytes_per_token(text_config: Any, model_impl: str, num_kv_heads: int, head_size: int, elem_size: int,
                              tp: int) -> int:
    """K and V of every layer, all ranks together; an MLA model (DeepSeek-V2/V3) keeps its latent and
    rotary key instead, whole on every rank (halserve.kv_cache.spec.MLASpec)."""
    from halserve.models.deepseek import is_deepseek_mla

    if model_impl == "halserve" and is_deepseek_mla(text_config):
        return tp * text_config.num_hidden_layers * (text_config.kv_lora_rank + text_config.qk_rope_head_dim) * elem_size
    return 2 * text_config.num_hidden_layers * num_kv_heads * head_size * elem_size


def resolve_model_impl(config: EngineConfig, hf_config: Any) -> tuple[str, str]:
    """(architecture, implementation) for ``config.model_impl``: ``halserve`` the first of the checkpoint's
    architectures that is registered; ``transformers`` its first architecture through transformers'
    modeling code (refused with the reason when that backend cannot run it); ``auto`` native when
    registered, else transformers (logged as a warning)."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    supported = supported_architectures()
    native = next((a for a in archs if a in supported), None)
    impl = getattr(config, "model_impl", "auto")
    if impl == "halserve" or (impl == "auto" and native is not None):
        if native is None:
            raise ValueError(
                f"model architecture {archs or '(none in config.json)'} of {config.model!r} is not supported; "
                f"supported architectures: {', '.join(sorted(supported)) or 'none registered'} "
                "(a plugin can add one through the halserve_model_architectures hook; --model-impl transformers "
                "or auto runs it with transformers' modeling code)"
            )
        return native, "halserve"
    if not archs:
        raise ValueError(f"the config.json of {config.model!r} names no architectures, so neither a native "
                         'implementation nor a transformers class can be chosen; add "architectures": [...]')
    from halserve.models.transformers_backend import TransformersBackendError, check_config

    arch = archs[0]
    try:
        check_config(config, hf_config, arch)
    except TransformersBackendError as exc:
        if impl == "auto":
            raise ValueError(
                f"model architecture {archs} of {config.model!r} has no native halserve implementation "
                f"(registered: {', '.join(sorted(supported)) or 'none'}), and the Transformers backend "
                f"fallback refuses it: {exc}") from None
        raise
    if impl == "auto":
        logger.warning("%s has no native halserve implementation: serving it with transformers' modeling code "
                       "and halserve's paged attention (the Transformers backend, --model-impl transformers)", arch)
    else:
        logger.info("serving %s with the Transformers modeling backend (--model-impl transformers)", arch)
    return arch, "transformers"


def _transformers_class(arch: str) -> type[ModelModule]:
    from halserve.models.transformers_backend import transformers_model_class

    return transformers_model_class(arch)


def _max_images(config: EngineConfig) -> int:
    from halserve.multimodal.processing import MAX_IMAGES_PER_PROMPT

    return (config.limit_mm_per_prompt or {}).get("image", MAX_IMAGES_PER_PROMPT)


def _check_tensor_parallel(tp: int, num_heads: int, num_kv_heads: int, hf_config: Any) -> None:
    """Before any rank starts: the model must split evenly over ``tp`` ranks (a KV head may be
    shared by several ranks)."""
    if tp == 1:
        return
    problems = []
    if num_heads % tp:
        problems.append(f"{num_heads} attention heads")
    if num_kv_heads % tp and tp % num_kv_heads:
        problems.append(f"{num_kv_heads} KV heads (nor do the ranks split evenly over them)")
    intermediate = getattr(hf_config, "intermediate_size", None)
    if isinstance(intermediate, int) and intermediate % tp:
        problems.append(f"an intermediate size of {intermediate}")
    if problems:
        sizes = [d for d in range(1, num_heads + 1) if not num_heads % d
                 and not (num_kv_heads % d and d % num_kv_heads)
                 and not (isinstance(intermediate, int) and intermediate % d)]
        raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {' and '.join(problems)}; "
                         f"sizes that fit: {', '.join(map(str, sizes))}")


def _check_pipeline_parallel(pp: int, arch: str, hf_config: Any, model_impl: str = "halserve") -> None:
    """Before any rank starts: the architecture splits into stages, and into ``pp`` of them."""
    from halserve.models.pipeline import layer_partition

    model_cls = _transformers_class(arch) if model_impl == "transformers" else model_class(arch)
    if not supports_pipeline_parallel(model_cls):
        raise ValueError(f"{arch} does not support pipeline parallelism; use pipeline_parallel_size=1 "
                         "(tensor_parallel_size shards it instead)")
    layer_partition(hf_config.num_hidden_layers, pp)


# -- weights ---------------------------------------------------------------------------
def safetensors_files(model_path: str) -> list[str]:
    """The checkpoint's shards: those the index names, else every *.safetensors file."""
    index = _read_json(os.path.join(model_path, "model.safetensors.index.json"))
    if index.get("weight_map"):
        names = sorted(set(index["weight_map"].values()))
        files = [os.path.join(model_path, n) for n in names]
    else:
        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    missing = [f for f in files if not os.path.isfile(f)]
    if not files or missing:
        raise ValueError(
            f"no usable safetensors weights in {model_path!r}"
            + (f" (missing shards: {', '.join(os.path.basename(m) for m in missing)})" if missing else "")
            + "; halserve loads *.safetensors checkpoints only"
        )
    return files


def iterate_weights(files: list[str], progress: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) pairs tensor by tensor; ``progress=None`` shows a bar for big checkpoints."""
    from safetensors import safe_open

    if progress is None:
        progress = len(files) > 1 or sum(os.path.getsize(f) for f in files) > PROGRESS_BAR_MIN_BYTES
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(files), desc="Loading safetensors shards", unit="shard")
    try:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


# vLLM's names for kernels of a format, accepted for the format itself
QUANTIZATION_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "compressed_tensors": "compressed-tensors",
                        "none": "unquantized"}
# formats that quantize a float checkpoint at load (the others need a quantized checkpoint)
ONLINE_QUANTIZATION = ("fp8",)


def get_quant_method(config: EngineConfig, info: ModelInfo, platform: Platform):
    """The QuantMethod instance for this checkpoint (``--quantization`` or its quantization_config)."""
    from halserve.plugins import get_plugin_manager

    quant_config = getattr(info.hf_config, "quantization_config", None)
    if quant_config is not None and not isinstance(quant_config, dict):
        quant_config = quant_config.to_dict()
    checkpoint_method = (quant_config or {}).get("quant_method")
    checkpoint_method = QUANTIZATION_ALIASES.get(checkpoint_method, checkpoint_method)
    flag = QUANTIZATION_ALIASES.get(config.quantization, config.quantization)
    gguf_file = getattr(info, "gguf_file", None)
    if gguf_file is not None or flag == "gguf":
        return _gguf_quant_method(flag, gguf_file, info, platform)
    if flag is not None and checkpoint_method is not None and flag != checkpoint_method:
        raise ValueError(f"--quantization {config.quantization} does not match the checkpoint's quantization "
                         f"{checkpoint_method!r} (config.json quantization_config); drop the flag or give "
                         f"--quantization {checkpoint_method}")
    if flag is not None and flag != "unquantized" and checkpoint_method is None and flag not in ONLINE_QUANTIZATION:
        raise ValueError(f"--quantization {config.quantization} needs a checkpoint quantized in that format (its "
                         f"config.json has no quantization_config); of a float checkpoint halserve can make "
                         f"{', '.join(ONLINE_QUANTIZATION)} at load")
    name = flag or checkpoint_method or "unquantized"
    registry = get_plugin_manager().quant_methods
    if name == "unquantized" and name not in registry:
        from halserve.quant_methods.unquantized import UnquantizedLinearMethod as cls
    elif name not in registry:
        raise ValueError(f"quantization {name!r} is not supported; registered: {', '.join(sorted(registry.names()))}")
    else:
        cls = registry[name].obj
    from halserve.layers.factory import layer_class, layer_overrides

    cls = layer_class(cls, layer_overrides(platform.name))  # a platform plugin's replacement (plugin API 2)
    reason = cls.supports(platform=platform.name, dtype=str(info.dtype).replace("torch.", ""))
    if reason is not None:
        raise ValueError(reason)
    return cls(platform.name, quant_config if checkpoint_method is not None else None)


def _gguf_quant_method(flag: str | None, gguf_file: str | None, info: ModelInfo, platform: Platform):
    """A GGUF checkpoint keeps its quantized linear weights in their blocks (the ``gguf`` method) unless
    ``--quantization unquantized`` (or ``none``) asks for every tensor dequantized at load."""
    if gguf_file is None:
        raise ValueError("--quantization gguf needs a GGUF checkpoint (a .gguf file, or a folder holding one)")
    if flag == "unquantized":
        from halserve.quant_methods.unquantized import UnquantizedLinearMethod

        return UnquantizedLinearMethod(platform.name)
    if flag not in (None, "gguf"):
        raise ValueError(f"--quantization {flag} does not apply to the GGUF checkpoint {gguf_file!r}; drop the flag "
                         "(its blocks stay quantized: gguf) or give --quantization unquantized to dequantize at load")
    from halserve.models.gguf import gguf_tensor_types
    from halserve.quant_methods.gguf import GgufLinearMethod

    return GgufLinearMethod(platform.name, {"quant_method": "gguf",
                                            "tensor_types": gguf_tensor_types(gguf_file, info.hf_config)})


def model_class(architecture: str, platform: str | None = None) -> type[ModelModule]:
    """The registered class of ``architecture`` (on ``platform``: a plugin's variant for it there),
    imported and checked against the model protocols (``halserve.models.architecture_class``)."""
    from halserve.models import architecture_class

    return architecture_class(architecture, platform)


DUMMY_WEIGHT_RANGE = 1e-3  # vLLM's: small enough that activations stay finite through any depth


def initialize_dummy_weights(model: torch.nn.Module, seed: int) -> set[str]:
    """``load_format="dummy"``: fill every parameter in place, on its device, with values drawn
    uniformly from +-DUMMY_WEIGHT_RANGE (+-1 in fp8) by a generator seeded with ``seed`` (the same
    seed gives the same weights on the same device); integer parameters (packed quantized weights)
    get random values in +-2**15. Returns the names of the parameters it filled."""
    filled = set()
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        device = param.device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        gen = generators[device]
        with torch.no_grad():
            if param.dtype in (torch.float32, torch.float16, torch.bfloat16):
                param.data.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=gen)
            elif param.dtype.is_floating_point:
                # fp8 (a quantized weight: its float scale makes it small): +-1, drawn in float32
                # (no uniform_ for fp8; +-1e-3 would round to zero there), then cast
                values = torch.empty(param.shape, dtype=torch.float32, device=device)
                values.uniform_(-1.0, 1.0, generator=gen)
                param.data.copy_(values)
                del values
            elif param.dtype == torch.bool:
                param.data.copy_(torch.randint(0, 2, param.shape, generator=gen, device=device).bool())
            else:
                info = torch.iinfo(param.dtype)
                low, high = max(info.min, -(1 << 15)), min(info.max, 1 << 15)
                param.data.copy_(torch.randint(low, high, param.shape, generator=gen, device=device, dtype=torch.int64))
        filled.add(name)
    return filled


def load_model(config: EngineConfig, info: ModelInfo, platform: Platform, attn_backend_cls: type,
               progress: bool | None = None) -> torch.nn.Module:
    """Build ``info.architecture`` on the platform's device in ``info.dtype`` and load its weights.

    ``progress``: True/False forces the loading progress bar on/off (None: automatic).
    """
    from halserve.layers.context import ModelContext

    model_cls = (_transformers_class(info.architecture) if info.model_impl == "transformers"
                 else model_class(info.architecture, platform.name))
    ctx = ModelContext(
        platform_name=platform.name,
        dtype=info.dtype,
        attn_backend_cls=attn_backend_cls,
        kv_cache_dtype=config.kv_cache_dtype,
        quant_method=get_quant_method(config, info, platform),
        max_position=info.max_model_len,
    )
    # parameters are created directly on the device, in ctx.dtype (layers pass it explicitly)
    with torch.device(platform.device()):
        model = model_cls(info.hf_config, ctx)
    load_format = getattr(config, "load_format", "auto")
    if load_format == "dummy":  # random weights, no checkpoint read (benchmarks)
        loaded = initialize_dummy_weights(model, config.seed)
    elif load_format not in ("auto", "safetensors"):  # a plugin's format (halserve_load_formats)
        from halserve.plugins.load_formats import get_load_format

        loaded = get_load_format(load_format)(config).load_weights(model, info.model_path)
    elif info.gguf_file is not None:  # dequantized to info.dtype as it streams, or kept in blocks (gguf method)
        from halserve.models.gguf import iterate_gguf_weights

        keep = getattr(ctx.quant_method, "quantized_names", ())
        dequantized = getattr(ctx.quant_method, "dequantized_layers", [])
        if dequantized:
            logger.info("GGUF: %d linear layers have a type without a quantized kernel and are dequantized at "
                        "load: %s%s", len(dequantized), ", ".join(dequantized[:4]), " ..." if len(dequantized) > 4 else "")
        loaded = model.load_weights(iterate_gguf_weights(info.gguf_file, info.hf_config, info.dtype, progress,
                                                         keep_quantized=keep))
    else:
        loaded = model.load_weights(iterate_weights(safetensors_files(info.model_path), progress))
    # a parameter marked ``optional`` (e.g. GPTQ's g_idx without act-order) may be absent
    missing = sorted(name for name, param in model.named_parameters()
                     if name not in loaded and not getattr(param, "optional", False))
    if missing:
        raise ValueError(f"checkpoint {info.model_path!r} has no weights for: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
        elif callable(getattr(module, "process_weights_after_loading", None)):
            module.process_weights_after_loading()  # e.g. the LM head's kernel repacking
    return model.eval()
