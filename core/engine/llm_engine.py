"""LLMEngine: the synchronous engine (vLLM's shape): add_request, step, abort_request."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from halserve.config import EngineConfig
from halserve.engine.core import EngineCore
from halserve.engine.output_processor import OutputProcessor
from halserve.engine.processor import InputProcessor, PromptType
from halserve.outputs import RequestOutput
from halserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from halserve.models.loader import ModelInfo


def load_tokenizer(config: EngineConfig, model_info: ModelInfo) -> Any:
    from transformers import AutoTokenizer

    from halserve.models.gguf import find_gguf_file, load_gguf_tokenizer

    path = config.tokenizer or model_info.model_path
    # a GGUF checkpoint carries its tokenizer (and chat template) in its metadata
    gguf_file = find_gguf_file(config.tokenizer) if config.tokenizer else getattr(model_info, "gguf_file", None)
    if gguf_file is not None:
        return load_gguf_tokenizer(gguf_file, config.trust_remote_code)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore(config)
        self.model_info = self.core.model_info
        self.tokenizer = load_tokenizer(config, self.model_info)
        self.input_processor = InputProcessor(self.model_info, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        return cls(config)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: Any = None,
        priority: int = 0,
    ) -> None:
        """Validate, tokenize and queue. Raises ValueError (and queues nothing) on bad input.
        ``lora_request``: a ``LoRARequest`` to run it with that adapter (needs enable_lora);
        ``priority``: lower runs first (needs ``scheduling_policy="priority"`` unless 0)."""
        request_id = str(request_id)
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use; give each request a unique id")
        params = apply_model_defaults(params, self.model_info)
        text, children = self.input_processor.process(request_id, prompt, params, arrival_time,
                                                      lora_request=lora_request, priority=priority)
        added = []
        try:
            for child in children:
                self.core.add_request(child)
                added.append(child.request_id)
        except ValueError:
            self.core.abort_requests(added)
            raise
        self.output_processor.add_request(text, children)

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step; outputs of the requests that progressed (only those that
        finished with ``final_only``, which spares building outputs nobody reads)."""
        core_outputs = self.core.step()
        outputs, to_abort = self.output_processor.process_outputs(core_outputs, final_only)
        self.core.abort_requests(to_abort)
        return outputs

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            self.core.abort_requests(self.output_processor.abort_request(rid))

    def add_lora(self, lora_request: Any) -> bool:
        """Load and validate an adapter ahead of its first request (ValueError if it cannot be served)."""
        return self.core.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.core.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.core.list_loras()

    # -- sleep mode and weight updates (EngineCore's) -------------------------------------
    def sleep(self, level: int = 1) -> None:
        self.core.sleep(level)

    def wake_up(self) -> None:
        self.core.wake_up()

    def is_sleeping(self) -> bool:
        return self.core.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def update_weights(self, path: str) -> None:
        self.core.update_weights(path)

    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict | None = None) -> list:
        return self.core.collective_rpc(method, args, kwargs)

    def has_unfinished_requests(self) -> bool:
        # The core is the source of truth: the output processor drops a parent as soon as
        # its last sample finishes (stop strings included).
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    def get_stats(self):
        return self.core.get_stats()

    def shutdown(self) -> None:
        self.core.shutdown()


def apply_model_defaults(params: SamplingParams, model_info: ModelInfo | None) -> SamplingParams:
    """The checkpoint's generation_config defaults for fields the user left unset (vLLM's
    ``generation_config="auto"``), and for an embedding request the model's pooling defaults
    (``halserve.pooler_config``) for the pooling params it left unset."""
    defaults = getattr(model_info, "generation_defaults", None)
    pooler_config = getattr(model_info, "pooler_config", None)
    pooling = params.pooling
    if pooling is not None and pooler_config is not None:
        pooling = pooling.with_defaults(pooler_config)
    if not defaults and pooling is params.pooling:
        return params
    params = params.clone()
    if defaults:
        params.update_from_generation_config(defaults)
    params.pooling = pooling
    return params
