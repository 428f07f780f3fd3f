"""LLMEngine: the synchronous engine (vLLM's shape): add_request, step, abort_request."""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from halserve.config import EngineConfig
from halserve.engine.core import EngineCore
from halserve.engine.output_processor import OutputProcessor
from halserve.engine.processor import InputProcessor, PromptType
from halserve.engine.request_stream import FinishedRequestStats
from halserve.outputs import RequestOutput
from halserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from halserve.models.loader import ModelInfo

logger = logging.getLogger(__name__)


def load_tokenizer(config: EngineConfig, model_info: ModelInfo) -> Any:
    from transformers import AutoTokenizer

    from halserve.models.gguf import find_gguf_file, load_gguf_tokenizer

    path = config.tokenizer or model_info.model_path
    # a GGUF checkpoint carries its tokenizer (and chat template) in its metadata
    gguf_file = find_gguf_file(config.tokenizer) if config.tokenizer else getattr(model_info, "gguf_file", None)
    if gguf_file is not None:
        tokenizer = load_gguf_tokenizer(gguf_file, config.trust_remote_code)
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code)
        except (OSError, ValueError) as exc:
            if config.tokenizer is None:  # (the model's own: transformers' error as it is)
                raise
            reason = " ".join(str(exc).split())  # (transformers' message spans several lines)
            raise ValueError(f"--tokenizer {path!r} holds no tokenizer transformers can load ({reason}); pass the "
                             "folder or hub id of the model's tokenizer (tokenizer.json / tokenizer_config.json) or a "
                             ".gguf file, or drop the flag to use the model's own") from exc
    # A --tokenizer larger than the model's vocabulary is another model's: refused at start. (A model's own may
    # have a few added tokens past it, e.g. transformers' <mask> for a Gemma GGUF that lacks one: a prompt
    # holding one is refused by the input processor.)
    if config.tokenizer is not None and len(tokenizer) > model_info.vocab_size:
        raise ValueError(f"--tokenizer {config.tokenizer!r} has {len(tokenizer)} tokens but the model's vocabulary "
                         f"(its embedding) has {model_info.vocab_size}: it is not this model's tokenizer; pass the "
                         "model's own tokenizer")
    return tokenizer


class LLMEngine:
    """``stat_observers``: objects whose ``on_request_stats(FinishedRequestStats)`` is called once per
    finished request, from ``step`` (``LLM(otlp_traces_endpoint=...)``'s ``RequestTracer``); an aborted
    request is not reported. ``shutdown`` calls their ``shutdown()`` where they have one (the tracer
    exports what it still holds)."""

    def __init__(self, config: EngineConfig, stat_observers: list[Any] | None = None) -> None:
        self.config = config
        self.core = EngineCore(config)
        self.model_info = self.core.model_info
        self.tokenizer = load_tokenizer(config, self.model_info)
        self.input_processor = InputProcessor(self.model_info, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_observers: list[Any] = list(stat_observers or [])
        # what a finished request's stats need that its RequestOutput lacks (only kept with observers):
        # request id -> (the first sample's params, the adapter's name)
        self._observed: dict[str, tuple[SamplingParams, str | None]] = {}

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
        if self.stat_observers:
            lora = children[0].lora_request
            self._observed[request_id] = (children[0].sampling_params, None if lora is None else lora.lora_name)

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step; outputs of the requests that progressed (only those that
        finished with ``final_only``, which spares building outputs nobody reads)."""
        core_outputs = self.core.step()
        outputs, to_abort = self.output_processor.process_outputs(core_outputs, final_only)
        self.core.abort_requests(to_abort)
        if self._observed:
            for out in outputs:
                if out.finished and out.request_id in self._observed:
                    self._report_finished(out, *self._observed.pop(out.request_id))
        return outputs

    def _report_finished(self, out: RequestOutput, params: SamplingParams, lora_name: str | None) -> None:
        metrics = out.metrics
        assert metrics is not None and metrics.finished_time is not None, "a finished output has its times"
        stats = FinishedRequestStats(
            request_id=out.request_id,
            finish_reason=next((o.finish_reason for o in out.outputs if o.finish_reason), "stop"),
            num_prompt_tokens=len(out.prompt_token_ids),
            num_generation_tokens=sum(len(o.token_ids) for o in out.outputs),
            num_cached_tokens=out.num_cached_tokens,
            params=params,
            n=len(out.outputs),
            max_tokens=params.max_tokens,
            lora_name=lora_name,
            arrival_time=metrics.arrival_time,
            first_scheduled_time=metrics.first_scheduled_time,
            first_token_time=metrics.first_token_time,
            last_token_time=metrics.last_token_time,
            finished_time=metrics.finished_time,
            prompt_text=out.prompt,
            trace_headers=None,
        )
        for observer in self.stat_observers:
            on_request_stats = getattr(observer, "on_request_stats", None)
            if on_request_stats is None:
                continue
            try:
                on_request_stats(stats)
            except Exception:  # noqa: BLE001 - a trace exporter's bug must not fail generate()
                logger.exception("request stats observer failed")

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            self._observed.pop(rid, None)
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
        try:
            self.core.shutdown()
        finally:
            for observer in self.stat_observers:
                if hasattr(observer, "shutdown"):
                    observer.shutdown()


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
