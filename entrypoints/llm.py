"""The offline API: ``LLM(model).generate(prompts, sampling_params)``, like vLLM's."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from halserve.config import EngineConfig
from halserve.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from halserve.pooling_params import PoolingParams
from halserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from halserve.beam_search import BeamSearchOutput, BeamSearchParams
    from halserve.lora.request import LoRARequest


class LLM:
    """An engine for offline batched generation.

    Args mirror vLLM's: ``num_kv_blocks`` fixes the KV cache size exactly (vLLM's
    ``num_gpu_blocks_override``); otherwise it is sized from ``kv_cache_memory`` bytes or
    from free memory. Any other ``EngineConfig`` field may be passed as a keyword, e.g.
    ``pooler_config={"pooling_type": "MEAN", "normalize": False}`` (embeddings, as vLLM's).
    ``allowed_local_media_path``: the directory ``chat``'s ``file://`` image URLs may read from
    (vLLM's; None: file URLs are refused); ``allowed_media_domains``: the hosts its http(s) image URLs
    may name (None: any). ``otlp_traces_endpoint``: send one OpenTelemetry span per finished request to this
    OTLP/HTTP collector URL, named and attributed as the server's ``--otlp-traces-endpoint`` spans
    (``halserve.tracing``; needs the ``halserve[otel]`` extra). Spans are exported in batches in the
    background; the rest at ``llm.llm_engine.shutdown()`` or at the process's exit.
    """

    def __init__(
        self,
        model: str,
        *,
        platform: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        tokenizer: str | None = None,
        allowed_local_media_path: str | None = None,
        allowed_media_domains: list[str] | None = None,
        otlp_traces_endpoint: str | None = None,
        **kwargs: Any,
    ) -> None:
        from halserve.engine.llm_engine import LLMEngine

        if otlp_traces_endpoint is not None:  # (a bad URL or a missing SDK: said before the model loads)
            from halserve.tracing import check_otel_installed, traces_url

            traces_url(otlp_traces_endpoint, "otlp_traces_endpoint=")
            check_otel_installed("otlp_traces_endpoint=")

        config = EngineConfig(
            model=model,
            platform=platform,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            tokenizer=tokenizer,
            **kwargs,
        )
        observers = []
        if otlp_traces_endpoint is not None:
            from halserve.tracing import RequestTracer

            observers.append(RequestTracer(otlp_traces_endpoint, model))
        self.llm_engine = LLMEngine(config, stat_observers=observers)
        self.allowed_local_media_path = allowed_local_media_path
        self.allowed_media_domains = allowed_media_domains
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt is a string, ``{"prompt_token_ids": [...]}`` or ``{"prompt": str}``.
        A bad prompt or parameter raises ValueError and leaves the engine usable.
        ``lora_request``: one LoRA adapter for every prompt, or one (or None) per prompt
        (needs ``enable_lora=True``). ``priority``: one integer per prompt, lower runs first
        (vLLM's; needs ``scheduling_policy="priority"`` unless all 0); None: all 0.
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (str, bytes, dict)) or not isinstance(sampling_params, Iterable):
            raise ValueError(
                f"sampling_params must be a SamplingParams or a list of them (one per prompt), "
                f"got {type(sampling_params).__name__}"
            )
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(prompts)} prompts but {len(params_list)} sampling params; give one, or one per prompt"
                )
        loras = _per_prompt_loras(lora_request, len(prompts))
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priorities)} priorities; give one per prompt")
        engine = self.llm_engine
        ids = [str(next(self._counter)) for _ in prompts]
        try:
            for rid, prompt, params, lora, prio in zip(ids, prompts, params_list, loras, priorities):
                engine.add_request(rid, prompt, params, lora_request=lora, priority=prio)
        except BaseException:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(
        self,
        prompts: str | dict | Sequence[str | dict | list[int]],
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (``halserve.beam_search``): per prompt, in input order, a
        ``BeamSearchOutput`` whose ``sequences`` are the ``params.beam_width`` best beams, best
        first. Prompts are given as to ``generate``; ``lora_request``: search with that adapter.
        Each step runs every live beam of every prompt as one batch of one-token requests. Bad
        input raises ValueError."""
        from halserve.beam_search import (
            BeamSearch,
            BeamSearchParams,
            first_token_logprobs,
            run_beam_search,
            step_sampling_params,
        )

        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        engine = self.llm_engine
        info = engine.model_info
        searches = [
            BeamSearch(engine.input_processor.tokenize(prompt)[1], params, info.eos_token_ids, info.max_model_len)
            for prompt in _prompt_list(prompts)
        ]
        step_params = step_sampling_params(params)

        def run_batch(token_lists: list[list[int]]) -> list:
            outputs = self.generate([{"prompt_token_ids": tokens} for tokens in token_lists], step_params,
                                    use_tqdm=False, lora_request=lora_request)
            return [first_token_logprobs(out) for out in outputs]

        return run_beam_search(searches, run_batch, self.get_tokenizer().decode)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate (``lora_request``
        as for ``generate``). A user message's content may hold OpenAI's image parts,
        ``{"type": "image_url", "image_url": {"url": ...}}`` (a data:, http(s): or file: URL, as
        ``halserve.multimodal.media.load_image`` reads them): the template writes the model's image
        placeholder for each and the images go to the model with the prompt."""
        from halserve.multimodal.media import load_image

        conversations = _conversations(messages)
        tokenizer = self.get_tokenizer()
        prompts = []
        for conv in conversations:
            conv, urls = _with_images(conv)
            try:
                ids = tokenizer.apply_chat_template(
                    conv, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=True
                )
            except Exception as exc:  # noqa: BLE001 - jinja's syntax and template errors
                raise ValueError(f"the chat template could not render the messages: {exc}") from None
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompt: dict[str, Any] = {"prompt_token_ids": list(ids)}
            if urls:
                where, domains = self.allowed_local_media_path, self.allowed_media_domains
                prompt["multi_modal_data"] = {"image": [
                    load_image(url, allowed_local_media_path=where, allowed_media_domains=domains) for url in urls]}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def embed(
        self,
        prompts: str | dict | Sequence[str | dict | list[int]],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order: the prompt's final hidden states pooled
        as the model's pooler config says (LAST, MEAN or CLS; the checkpoint's
        sentence-transformers files or ``LLM(..., pooler_config=...)``), normalized unless it
        or ``pooling_params`` says otherwise. ``truncate_prompt_tokens``: embed only each prompt's
        last k tokens (-1: as many as fit), as ``SamplingParams.truncate_prompt_tokens``;
        ``lora_request`` as in ``generate``."""
        params = _pooling_request_params(pooling_params, prompts, truncate_prompt_tokens, "embed")
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)
        return [embedding_output(out) for out in outputs]

    def classify(
        self,
        prompts: str | dict | Sequence[str | dict | list[int]],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """vLLM's classify, for a classification model (a ``*ForSequenceClassification`` checkpoint,
        reward models included): per prompt, in input order, ``.outputs.probs``, its class
        probabilities (id2label order) from the model's ``score`` head on its last token's final
        hidden state: a softmax over the classes, a sigmoid with a single label (or
        ``problem_type`` multi_label_classification), the logits as they are for regression;
        ``PoolingParams(activation=False)`` returns the raw logits. ``truncate_prompt_tokens``
        and ``lora_request`` as in ``embed``. A generative model raises ValueError."""
        params = _pooling_request_params(pooling_params, prompts, truncate_prompt_tokens, "classify")
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)
        return [classification_output(out) for out in outputs]

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's score for an embedding model: per pair, in order, the cosine similarity of the
        two texts' embeddings (``.outputs.score``). ``text_1`` and ``text_2`` (strings or lists of
        strings) pair 1:1, 1:N or N:N (``halserve.scoring``); each distinct text is embedded once,
        as ``embed`` would (``truncate_prompt_tokens`` likewise), with ``lora_request``'s adapter
        if given. Bad input raises ValueError naming the argument."""
        from halserve.lora.request import LoRARequest
        from halserve.scoring import pair_scores, pair_texts

        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be one LoRARequest (for every text) or None, "
                             f"got {type(lora_request).__name__}")
        batch = pair_texts(text_1, text_2)
        params = embedding_params(PoolingParams(), truncate_prompt_tokens)
        try:
            finals = self.generate(batch.texts, params, use_tqdm=use_tqdm, lora_request=lora_request)
        except ValueError as exc:  # name the text it is about (generate stops at the first bad one)
            processor = self.llm_engine.input_processor
            for text, name in zip(batch.texts, batch.text_params):
                try:
                    processor.process("score-check", text, params, lora_request=lora_request)
                except ValueError as text_exc:
                    raise ValueError(f"{name}: {text_exc}") from None
            raise exc
        outputs = [embedding_output(out) for out in finals]
        scores = pair_scores(batch, [out.outputs.embedding for out in outputs])
        return [ScoringRequestOutput(request_id=str(next(self._counter)),
                                     prompt_token_ids=outputs[i].prompt_token_ids + outputs[j].prompt_token_ids,
                                     outputs=ScoringOutput(score))
                for (i, j), score in zip(batch.pairs, scores)]

    # -- sleep mode and weight updates (vLLM's) ----------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Put the engine to sleep (needs ``LLM(..., enable_sleep_mode=True)``), handing its memory back to
        the OS (CPU) or the device driver (GPU) until ``wake_up``.

        Level 1 drops the KV cache and keeps the weights in host memory (on the CPU they already live
        there: level 1 frees the KV cache alone); level 2 drops the weights too, and ``wake_up`` reloads
        them from the checkpoint (or from the one ``update_weights`` loaded). The prefix cache is reset.
        While asleep, ``generate`` and friends raise ``EngineSleepingError`` (a ValueError) naming
        ``wake_up``."""
        self.llm_engine.sleep(level)

    def wake_up(self) -> None:
        """Take back the weights and the KV cache; requests run again (a no-op when awake)."""
        self.llm_engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after changing the weights by ``collective_rpc``); True when done."""
        return self.llm_engine.reset_prefix_cache()

    def update_weights(self, path: str) -> None:
        """Serve the weights of the checkpoint folder ``path`` (config.json and *.safetensors of the same
        architecture and sizes) from now on, awake or asleep. A checkpoint that does not match is a
        ValueError naming the mismatch, and the old weights keep serving. The prefix cache is reset."""
        self.llm_engine.update_weights(path)

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's: ``Worker.<method>(*args, **kwargs)`` on every worker (``halserve.worker.worker.Worker``;
        a function is called as ``method(worker, *args, **kwargs)``); one result per worker, by rank.
        ``timeout`` is not supported (None); the mp executor's HALSERVE_MP_RPC_TIMEOUT_S bounds every call."""
        if timeout is not None:
            raise ValueError(f"collective_rpc: timeout={timeout!r} is not supported; pass None (set "
                             "HALSERVE_MP_RPC_TIMEOUT_S to bound the mp executor's calls)")
        return self.llm_engine.collective_rpc(method, tuple(args), kwargs)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step(final_only=True):
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids if i in finished]


def _prompt_list(prompts: Any) -> list:
    """``prompts`` as a list (one prompt, a string or a dict, becomes a list of one)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise ValueError(
            f"prompts must be a string, a prompt dict, or a list of strings, token-id lists or prompt dicts; "
            f"got {type(prompts).__name__}"
        )
    return list(prompts)


def _per_prompt_loras(lora_request: Any, num_prompts: int) -> list:
    """``lora_request`` as one entry (a LoRARequest or None) per prompt."""
    if lora_request is None or not isinstance(lora_request, (list, tuple)):
        return [lora_request] * num_prompts
    if len(lora_request) != num_prompts:
        raise ValueError(f"got {num_prompts} prompts but {len(lora_request)} lora requests; "
                         "give one, or one per prompt")
    return list(lora_request)


def _conversations(messages: Any) -> list[list[dict]]:
    """``messages`` as a list of conversations; ValueError naming the expected shape."""
    def is_conversation(value: Any) -> bool:
        return (isinstance(value, list) and bool(value)
                and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value))

    if is_conversation(messages):
        return [messages]
    if isinstance(messages, list) and messages and all(is_conversation(c) for c in messages):
        return messages
    raise ValueError(
        "messages must be a conversation (a non-empty list of {'role': ..., 'content': ...} dicts) or a list of "
        f"such conversations; got {messages!r:.80}"
    )


def _with_images(conversation: list[dict]) -> tuple[list[dict], list[str]]:
    """``(messages as the template reads them, image URLs in order)``: messages with image_url parts
    read as the server reads them (``ChatMessage.template_dict``), the others as given."""
    from pydantic import ValidationError

    from halserve.entrypoints.openai.chat_protocol import ChatMessage

    def has_image(message: dict) -> bool:
        content = message.get("content")
        return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content)

    messages, urls = [], []
    for i, message in enumerate(conversation):
        if not has_image(message):
            messages.append(message)
            continue
        try:
            parsed = ChatMessage.model_validate(message)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(x) for x in e['loc'] if '[' not in str(x)) or 'message'}: "
                f"{str(e['msg']).removeprefix('Value error, ')}" for e in exc.errors(include_url=False))
            raise ValueError(f"messages[{i}]: {problems}") from None
        messages.append(parsed.template_dict())
        urls.extend(parsed.image_urls())
    return messages, urls


def _pooling_request_params(pooling_params: Any, prompts: Any, truncate_prompt_tokens: int | None,
                            task: str) -> SamplingParams | list[SamplingParams]:
    """The sampling params of ``LLM.embed`` / ``LLM.classify`` (``task``): one for every prompt, or
    one per prompt; ValueError for anything else, or pooling params of the other task."""
    def with_task(pooling: PoolingParams) -> SamplingParams:
        if pooling.task not in (None, task):
            raise ValueError(f"pooling params with task {pooling.task!r} were given to LLM.{task}; "
                             f"leave task unset (or {task!r})")
        return embedding_params(replace(pooling, task=task), truncate_prompt_tokens)

    if pooling_params is None or isinstance(pooling_params, PoolingParams):
        return with_task(pooling_params or PoolingParams())
    if isinstance(pooling_params, (list, tuple)) and all(isinstance(p, PoolingParams) for p in pooling_params):
        if len(pooling_params) != len(_prompt_list(prompts)):
            raise ValueError(f"got {len(_prompt_list(prompts))} prompts but {len(pooling_params)} pooling params; "
                             "give one, or one per prompt")
        return [with_task(p) for p in pooling_params]
    raise ValueError(f"pooling_params must be a PoolingParams or a list of them (one per prompt), "
                     f"got {type(pooling_params).__name__}")


def embedding_params(pooling: PoolingParams, truncate_prompt_tokens: int | None = None) -> SamplingParams:
    """A pooling (embed or classify) request's sampling params: it ends with its pooled result
    and generates no token (max_tokens=1 only bounds the prompt's room, as for a generation)."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False, pooling=pooling,
                          truncate_prompt_tokens=truncate_prompt_tokens)


def classification_output(out: RequestOutput) -> ClassificationRequestOutput:
    if out.probs is None:
        raise RuntimeError(f"request {out.request_id} finished without class probabilities: this platform's model "
                           "runner does not pool")
    return ClassificationRequestOutput(request_id=out.request_id, prompt_token_ids=out.prompt_token_ids,
                                       outputs=ClassificationOutput(out.probs))


def embedding_output(out: RequestOutput) -> EmbeddingRequestOutput:
    if out.embedding is None:
        raise RuntimeError(
            f"request {out.request_id} finished without an embedding: this platform's model runner does not pool"
        )
    return EmbeddingRequestOutput(request_id=out.request_id, prompt_token_ids=out.prompt_token_ids,
                                  outputs=EmbeddingOutput(out.embedding))
