"""User-facing engine configuration (what `LLM(...)` and `halserve serve` flags set)."""
from __future__ import annotations

import logging
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from halserve.attention_backends.base import KV_CACHE_DTYPES
from halserve.kv_connectors.base import KVTransferConfig
from halserve.pooler_config import PoolerConfig
from halserve.sampling_params import MAX_LOGPROBS
from halserve.spec_decode.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_MAX_CPU_LORAS = 8
LOAD_FORMATS = ("auto", "safetensors", "dummy")
MODEL_IMPLS = ("auto", "halserve", "transformers")
logger = logging.getLogger(__name__)
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}


class EngineConfig(BaseModel):
    """Everything that shapes one engine. Validated on construction; plugins may adjust it
    (``halserve_update_config``) after the platform is chosen."""

    model_config = ConfigDict(validate_assignment=True, extra="forbid")

    model: str
    """A local HF directory or a hub id."""
    tokenizer: str | None = None
    """Tokenizer directory or hub id; defaults to ``model``."""
    hf_config_path: str | None = None
    """Directory or hub id of a config.json to use instead of the model's (vLLM's ``--hf-config-path``;
    for a GGUF file: instead of the config its metadata gives)."""
    revision: str | None = None
    platform: str | None = None
    """Platform name; None auto-detects (``HALSERVE_PLATFORM`` also selects)."""
    dtype: str = "auto"
    """Model dtype; ``auto`` takes the checkpoint's if the platform supports it."""
    max_model_len: int | None = Field(default=None, ge=1)
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    block_size: int = Field(default=16, ge=1)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    """Fix the KV cache at exactly this many blocks (like vLLM's num_gpu_blocks_override)."""
    kv_cache_memory: int | None = Field(default=None, ge=1)
    """Bytes for the KV cache; None sizes it from free device memory."""
    kv_cache_memory_fraction: float = Field(default=0.9, gt=0, le=1)
    """Fraction of free memory the KV cache may take when sized automatically."""
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    """vLLM's ``--gpu-memory-utilization``: the fraction of the device's *total* memory this engine may
    use -- weights, activations and KV cache together; the KV cache gets that share less what this
    process holds once the model is loaded (``Platform.kv_cache_budget_of_total``; on the CPU the
    device memory is the host's RAM). None: ``kv_cache_memory_fraction`` of free memory instead."""
    enable_chunked_prefill: bool = True
    """Split long prompts into chunks of the step's token budget (vLLM's ``--enable-chunked-prefill``).
    False: a prompt is prefilled in one step, so ``max_num_batched_tokens`` is raised to at least
    ``max_model_len`` once the model's length is known (``fit_unchunked_prefill``)."""
    generation_config: str = "auto"
    """Sampling defaults for fields a request leaves unset (vLLM's ``--generation-config``): ``auto``
    the checkpoint's generation_config.json; ``vllm`` none (halserve's own defaults); a folder: the
    generation_config.json in it."""
    max_logprobs: int = Field(default=MAX_LOGPROBS, ge=-1, le=MAX_LOGPROBS)
    """Most ``logprobs``/``prompt_logprobs`` a request may ask for (vLLM's ``--max-logprobs``); -1: as
    many as halserve returns (``MAX_LOGPROBS``). A request over it gets a ValueError (HTTP 400)."""
    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    """Schedule step N+1 while step N runs (vLLM's ``--async-scheduling``); the worker fills in step N's
    sampled tokens. Outputs are the same as without it. A feature that cannot run asynchronously yet
    (``halserve.sched.async_steps.async_refusal``) turns it off at start-up with a warning. With no
    ``distributed_executor_backend`` named, the worker runs in a process of its own (``mp``)."""
    scheduling_policy: str = "fcfs"
    """vLLM's ``--scheduling-policy``: ``fcfs`` serves requests in arrival order (a request's ``priority``
    must be 0); ``priority`` by (``priority``, arrival), lower first, preempting running requests of a
    lower priority for a waiting one that cannot otherwise be admitted. Outputs are the same."""
    seed: int = 0
    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    """Pipeline stages: the decoder layers are split into this many consecutive stages, each
    ``tensor_parallel_size`` ranks wide (``world_size = tensor_parallel_size * pipeline_parallel_size``)."""
    distributed_executor_backend: str | None = None
    """Executor plugin name; None picks ``uni`` for one rank, else ``mp``."""
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    attention_backend: str | None = None
    """Force one attention backend by name (``HALSERVE_ATTENTION_BACKEND`` also does)."""
    trust_remote_code: bool = False
    pooler_config: PoolerConfig | None = None
    """Embedding pooling (``pooling_type``: LAST, MEAN, CLS; ``normalize``) over the checkpoint's
    sentence-transformers defaults; a dict or JSON string is accepted (vLLM's ``pooler_config``)."""
    enable_lora: bool = False
    """Serve LoRA adapters in PEFT's format, chosen per request (``lora_request``)."""
    max_loras: int = Field(default=1, ge=1)
    """Most distinct adapters running at once (one step holds at most this many)."""
    max_lora_rank: int = Field(default=16, ge=1)
    """Adapters of a higher rank r are refused."""
    max_cpu_loras: int | None = Field(default=None, ge=1)
    """Adapters each worker keeps loaded (LRU); None: ``max(max_loras, DEFAULT_MAX_CPU_LORAS)``."""
    limit_mm_per_prompt: dict[str, int] | None = None
    """A vision-language model's most images per prompt (vLLM's ``{"image": 4}``; 0 refuses images); a
    JSON string is accepted. None: ``halserve.multimodal.processing.MAX_IMAGES_PER_PROMPT``."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """A vision-language model's image-processor overrides (vLLM's), e.g. Qwen2-VL's
    ``{"max_pixels": 802816}``; a JSON string is accepted. None: the checkpoint's settings."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (``{"method": "ngram", "num_speculative_tokens": 4}``); a dict or JSON
    string is accepted (vLLM's ``speculative_config``). None: off."""
    kv_transfer_config: KVTransferConfig | None = None
    """A KV connector (``{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {"shared_storage_path": "/mnt/kv"}}``): K/V blocks loaded from and
    saved outside the KV cache; a dict or JSON string is accepted (vLLM's). None: off."""
    enforce_eager: bool = False
    """Run every step eagerly (vLLM's ``--enforce-eager``): no captured graphs even where the
    platform offers them (``Platform.graph_capture``)."""
    max_cudagraph_capture_size: int | None = Field(default=None, ge=1)
    """Largest decode batch captured as a graph (vLLM's ``--max-cudagraph-capture-size``); bigger
    decode steps run eagerly. None: ``min(max_num_seqs, 512)`` (halserve.worker.capture_sizes)."""
    load_format: str = "auto"
    """``auto``/``safetensors``: read the checkpoint; ``dummy``: random weights of the right shapes
    and dtypes made on the device from ``seed`` (benchmarks without a download; vLLM's); another name:
    a plugin's format (``halserve_load_formats``, ``halserve.plugins.LoadFormat``)."""
    model_impl: str = "auto"
    """Which code runs the model (vLLM's ``--model-impl``): ``halserve`` its native implementation;
    ``transformers`` transformers' own modeling code with halserve's paged attention plugged in
    (``halserve.models.transformers_backend``); ``auto`` the native one when the architecture is
    registered, else transformers' (logged as a warning)."""
    kv_offloading_size: float | None = Field(default=None, gt=0)
    """GiB of host memory for a second prefix-cache tier (vLLM's ``--kv-offloading-size``): shorthand
    for the ``OffloadingConnector`` with that ``cpu_bytes_to_use``. None: off."""
    enable_sleep_mode: bool = False
    """vLLM's ``enable_sleep_mode`` (``--enable-sleep-mode``): the engine may ``sleep(level)`` between
    bursts of work, releasing its KV cache (level 1) or its weights and KV cache (level 2) to the OS or
    the device driver, and ``wake_up()`` again (halserve.worker.sleep_mode)."""

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: object) -> str:
        name = str(value).replace("torch.", "")
        name = _DTYPE_ALIASES.get(name, name)
        if name not in DTYPES:
            raise ValueError(f"dtype {value!r} is not supported; use one of {', '.join(DTYPES)}")
        return name

    @field_validator("load_format")
    @classmethod
    def _load_format(cls, value: str) -> str:
        if value in LOAD_FORMATS:
            return value
        from halserve.plugins.load_formats import check_load_format_name  # plugins' formats (plugin API 2)

        return check_load_format_name(value)

    @field_validator("model_impl")
    @classmethod
    def _model_impl(cls, value: str) -> str:
        if value not in MODEL_IMPLS:
            raise ValueError(f"model_impl {value!r} is not supported; use one of {', '.join(MODEL_IMPLS)}")
        return value

    @field_validator("scheduling_policy")
    @classmethod
    def _scheduling_policy(cls, value: str) -> str:
        from halserve.sched.config import SCHEDULING_POLICIES

        if value not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy {value!r} is not supported; use one of {', '.join(SCHEDULING_POLICIES)}")
        return value

    @field_validator("kv_cache_dtype")
    @classmethod
    def _kv_dtype(cls, value: str) -> str:
        if value not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {value!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}")
        return value

    @field_validator("pooler_config", mode="before")
    @classmethod
    def _pooler_config(cls, value: object) -> object:
        return None if value is None else PoolerConfig.parse(value)

    @field_validator("mm_processor_kwargs", mode="before")
    @classmethod
    def _mm_processor_kwargs(cls, value: object) -> object:
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"mm_processor_kwargs must be a JSON object like '{{\"max_pixels\": 802816}}': "
                                 f"{exc}") from None
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"mm_processor_kwargs must be a dict like {{'max_pixels': 802816}}, got {value!r}")
        return value

    @field_validator("limit_mm_per_prompt", mode="before")
    @classmethod
    def _limit_mm_per_prompt(cls, value: object) -> object:
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"limit_mm_per_prompt must be JSON like '{{\"image\": 4}}': {exc}") from None
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError(f"limit_mm_per_prompt must be a dict like {{'image': 4}}, got {value!r}")
        for key, limit in value.items():
            if key != "image":
                raise ValueError(f"limit_mm_per_prompt: {key!r} inputs are not supported; only 'image'")
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise ValueError(f"limit_mm_per_prompt['image'] must be an integer >= 0, got {limit!r}")
        return value

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _speculative_config(cls, value: object) -> object:
        return None if value is None else SpeculativeConfig.parse(value)

    @field_validator("kv_transfer_config", mode="before")
    @classmethod
    def _kv_transfer_config(cls, value: object) -> object:
        return None if value is None else KVTransferConfig.parse(value)

    @model_validator(mode="after")
    def _kv_offloading(self) -> EngineConfig:
        if self.kv_offloading_size is not None:
            if self.kv_transfer_config is not None:
                raise ValueError("kv_offloading_size and kv_transfer_config both ask for a KV connector; give one "
                                 "(kv_offloading_size is the OffloadingConnector with cpu_bytes_to_use)")
            cpu_bytes = int(self.kv_offloading_size * (1 << 30))
            self.__dict__["kv_transfer_config"] = KVTransferConfig(
                kv_connector="OffloadingConnector", kv_connector_extra_config={"cpu_bytes_to_use": cpu_bytes})
            self.__dict__["kv_offloading_size"] = None
        return self

    @field_validator("max_logprobs")
    @classmethod
    def _max_logprobs(cls, value: int) -> int:
        return MAX_LOGPROBS if value == -1 else value

    @field_validator("generation_config")
    @classmethod
    def _generation_config(cls, value: str) -> str:
        if value in ("auto", "vllm"):
            return value
        if not os.path.isfile(os.path.join(os.path.expanduser(value), "generation_config.json")):
            raise ValueError(f"generation_config {value!r}: not 'auto', 'vllm' or a folder holding "
                             "generation_config.json")
        return value

    @model_validator(mode="after")
    def _sleep_mode(self) -> EngineConfig:
        if not self.enable_sleep_mode:
            return self
        if self.kv_transfer_config is not None:
            raise ValueError("enable_sleep_mode cannot be combined with a KV connector (kv_transfer_config or "
                             "kv_offloading_size) yet: the connector holds the KV cache that sleep drops; drop one")
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model":
            raise ValueError("enable_sleep_mode cannot be combined with a draft model (speculative_config) yet: "
                             "its weights and KV cache are not released; use method 'ngram' or no speculation")
        return self

    @model_validator(mode="after")
    def _memory_share(self) -> EngineConfig:
        if self.gpu_memory_utilization is None:
            return self
        if "kv_cache_memory_fraction" in self.model_fields_set:
            raise ValueError("gpu_memory_utilization (vLLM's: a share of total device memory for everything) and "
                             "kv_cache_memory_fraction (halserve's: a share of free memory for the KV cache) both "
                             "size the KV cache; give one")
        if self.kv_cache_memory is not None:
            raise ValueError("gpu_memory_utilization and kv_cache_memory both size the KV cache; give one")
        return self

    def fit_unchunked_prefill(self, max_model_len: int) -> None:
        """With ``enable_chunked_prefill`` off, raise ``max_num_batched_tokens`` to ``max_model_len`` (the
        longest prompt must fit one step, as vLLM requires); called once the model's length is known."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            logger.info("chunked prefill is off: max_num_batched_tokens %d -> %d (max_model_len), so a whole "
                        "prompt fits one step", self.max_num_batched_tokens, max_model_len)
            self.max_num_batched_tokens = max_model_len

    @model_validator(mode="after")
    def _lora_limits(self) -> EngineConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): "
                             "every running adapter stays loaded")
        return self

    @property
    def world_size(self) -> int:
        """Ranks (worker processes) the engine runs: tensor x pipeline parallel size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_name(self) -> str:
        """The executor plugin to run: the one asked for, else ``uni`` for one rank, ``mp`` for more."""
        return self.distributed_executor_backend or ("uni" if self.world_size == 1 else "mp")

    @property
    def resolved_max_cpu_loras(self) -> int:
        return self.max_cpu_loras or max(self.max_loras, DEFAULT_MAX_CPU_LORAS)

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"block_size must be a power of two (e.g. 16), got {value}")
        return value
