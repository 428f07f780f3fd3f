"""AsyncLLM: the engine behind the server. EngineCore steps behind an ``EngineCoreClient``
(core_client.py): in a thread of this process (``EngineThread``) or in a process of its own
(``MPEngineCoreClient``, ``halserve serve``'s default); text stays on the asyncio side.

    asyncio loop (server)                          engine core (thread or process)
    ---------------------                          -------------------------------
    add_request: InputProcessor (tokenizer pool)
                 ---- add (core requests) ------->  EngineCore.add_request (ack back)
    abort:       ---- abort (child ids) --------->  EngineCore.abort_requests
                                                    while work: step()
    _on_outputs: OutputProcessor (detokenize,  <--  each step's outputs (+ stats)
                 stop strings), per-request
                 queues, metrics
                 stop-string aborts ------------->  EngineCore.abort_requests

The core is only ever touched by its own thread or process; ``get_stats`` reads the snapshot
it publishes after every step. If it dies, every stream gets ``EngineDeadError``,
``is_healthy`` turns False and the ``death_callbacks`` run (the server exits non-zero).
"""
from __future__ import annotations

import asyncio
import copy
import functools
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from halserve.engine.core_client import EngineCoreClient
from halserve.engine.engine_thread import EngineThread
from halserve.engine.request_stream import (
    EngineDeadError,
    FinishedRequestStats,
    PreparedRequest,
    RequestState,
    RequestStream,
    StatsObserver,
)
from halserve.engine.types import EngineStats
from halserve.tracing import current_trace_headers

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Sequence

    from halserve.beam_search import BeamSearchOutput, BeamSearchParams
    from halserve.config import EngineConfig
    from halserve.engine.core import EngineCore
    from halserve.engine.output_processor import OutputProcessor
    from halserve.engine.processor import InputProcessor
    from halserve.lora.request import LoRARequest
    from halserve.outputs import RequestOutput
    from halserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream", "StatsObserver"]

# Prompts longer than this (characters or token ids) are processed in the tokenizer
# thread so a long tokenization (or a per-id check) never stalls the event loop.
_INLINE_PROMPT_LIMIT = 256


class AsyncLLM:
    """Async front of an ``EngineCore`` (see the module docstring).

    Build it with ``AsyncLLM.from_config`` (loads the model) or pass the pieces: an
    ``engine_core`` (stepped in an ``EngineThread``) or a ``client``; the client starts on
    first use inside a running event loop (or ``start()``).
    """

    def __init__(
        self,
        engine_core: EngineCore | None,
        input_processor: InputProcessor,
        output_processor: OutputProcessor,
        tokenizer: Any = None,
        stat_observers: list[StatsObserver] | None = None,
        client: EngineCoreClient | None = None,
    ) -> None:
        if client is None:
            if engine_core is None:
                raise ValueError("AsyncLLM needs an engine_core (stepped in a thread) or a client")
            client = EngineThread(engine_core)
        self.client: EngineCoreClient = client
        # the core itself when it runs in this process; None when it runs in another
        self.engine_core = getattr(client, "engine_core", None)
        self.client.bind(self._on_outputs, self._on_dead)
        self.input_processor = input_processor
        self.output_processor = output_processor
        self.tokenizer = tokenizer
        self.model_info = self.client.model_info
        self.stat_observers: list[StatsObserver] = list(stat_observers or [])
        self.dead_error: BaseException | None = None
        # run on the event loop once, after every stream got the error (the server exits)
        self.death_callbacks: list[Callable[[BaseException], None]] = []
        self._requests: dict[str, RequestState] = {}
        self._child_to_parent: dict[str, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown = False
        self._ids = itertools.count()
        self.tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="halserve-tokenizer")

    @classmethod
    def from_config(cls, config: EngineConfig, stat_observers: list[StatsObserver] | None = None,
                    multiprocess: bool = False, log_level: int = logging.WARNING) -> AsyncLLM:
        """Load the model (EngineCore, in this process or with ``multiprocess`` in an engine-core
        process of its own), the tokenizer and the processors."""
        from halserve.engine.core import EngineCore
        from halserve.engine.core_client import start_engine_core_process

        if multiprocess:
            return cls.from_client(config, start_engine_core_process(config, log_level), stat_observers)
        return cls.from_client(config, EngineThread(EngineCore(config)), stat_observers)

    @classmethod
    def from_client(cls, config: EngineConfig, client: EngineCoreClient,
                    stat_observers: list[StatsObserver] | None = None) -> AsyncLLM:
        """The front of a started core: load the tokenizer and the processors (``client`` is
        released if that fails)."""
        from halserve.engine.llm_engine import load_tokenizer
        from halserve.engine.output_processor import OutputProcessor
        from halserve.engine.processor import InputProcessor

        try:
            info = client.model_info
            if info is None:
                raise RuntimeError("the engine core started without reporting its model")
            tokenizer = load_tokenizer(config, info)
            return cls(
                None,
                InputProcessor(info, tokenizer, reject_max_tokens_past_context=True),  # (the server's: a 400)
                OutputProcessor(tokenizer),
                tokenizer,
                stat_observers,
                client=client,
            )
        except BaseException:
            client.close_sync()
            raise

    # ------------------------------------------------------------------ lifecycle
    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and not self._shutdown

    def start(self) -> None:
        """Start the engine client, bound to the running event loop (idempotent)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self.client.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every in-flight request (their streams end with finish_reason "abort"),
        stop the engine thread and release the core. Idempotent."""
        if self._shutdown:
            return
        self._shutdown = True
        for request_id in list(self._requests):
            self._finish_aborted(request_id)
        await self.client.stop(timeout)
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    def request_shutdown(self) -> None:
        """Schedule ``shutdown()`` on the engine's event loop; safe from any thread or a
        signal handler."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.shutdown()))

    def get_stats(self) -> EngineStats:
        """The latest snapshot published by the engine core (cheap, any thread)."""
        return self.client.stats

    # ------------------------------------------------------------------ requests
    async def add_request(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        request_id: str | None = None,
        prompt_text: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Validate, tokenize and queue one request; returns its stream.

        Raises ``ValueError`` (bad input: the caller's fault, a 400) before anything is
        queued, and ``EngineDeadError`` when the engine cannot take requests. ``priority``: lower
        runs first (needs ``--scheduling-policy priority`` unless 0).
        """
        return await self.submit(await self.prepare_request(prompt, params, request_id, prompt_text, lora_request,
                                                            priority))

    async def prepare_request(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        request_id: str | None = None,
        prompt_text: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> PreparedRequest:
        """``add_request``'s first half: validate and tokenize, queue nothing (a batch checks
        every prompt before it queues any)."""
        self._check_alive()
        self.start()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight; use a unique id")
        from halserve.engine.llm_engine import apply_model_defaults

        arrival = time.time()
        params = apply_model_defaults(params, self.model_info)
        process = functools.partial(self.input_processor.process, lora_request=lora_request, priority=priority)
        if _prompt_size(prompt) > _INLINE_PROMPT_LIMIT:
            text, core_requests = await asyncio.get_running_loop().run_in_executor(
                self.tokenizer_pool, process, request_id, prompt, params, arrival
            )
        else:
            text, core_requests = process(request_id, prompt, params, arrival)
        return PreparedRequest(request_id, prompt_text if prompt_text is not None else text, core_requests, arrival)

    async def submit(self, prepared: PreparedRequest) -> RequestStream:
        """``add_request``'s second half: queue a prepared request; returns its stream."""
        return (await self.submit_all([prepared]))[0]

    async def submit_all(self, prepared: Sequence[PreparedRequest]) -> list[RequestStream]:
        """Queue prepared requests (a batch's prompts) in one engine round trip, all or none;
        returns their streams. The core's refusal of one (e.g. it can never fit in the KV cache)
        is a ValueError here whose ``batch_index`` is that request's place in ``prepared``, and
        nothing is queued. (One round trip, not one per request: the core answers between steps,
        so a 64-prompt batch queued one at a time waited ~64 steps for its last prompt.)"""
        self._check_alive()
        seen: set[str] = set()
        for item in prepared:
            if item.request_id in self._requests or item.request_id in seen:
                raise ValueError(f"request id {item.request_id!r} is already in flight; use a unique id")
            seen.add(item.request_id)
        states = [self._register(item) for item in prepared]
        core_requests = [request for item in prepared for request in item.core_requests]
        # The core may still refuse one: wait for its verdict so that is a ValueError here,
        # not a broken stream.
        try:
            error = await self.client.add_requests(core_requests)
        except BaseException:
            for state in states:
                self._drop(state.request_id, abort_core=True)
            raise
        if error is not None:
            for state in states:
                self._drop(state.request_id, abort_core=True)
            refused = getattr(error, "request_id", None)  # (the core names the child it refused)
            parent = next((i for i, state in enumerate(states) if refused in state.child_ids), 0)
            if isinstance(error, ValueError):
                error.batch_index = parent  # type: ignore[attr-defined]
            raise error
        for state in states:
            for observer in self.stat_observers:
                observer.on_request_added(len(state.prompt_token_ids))
        return [state.stream for state in states]

    def _register(self, prepared: PreparedRequest) -> RequestState:
        """The API-server side of a request about to be queued: its state and stream."""
        request_id, prompt_text, core_requests, arrival = (
            prepared.request_id, prepared.prompt_text, prepared.core_requests, prepared.arrival_time
        )
        state = RequestState(
            request_id=request_id,
            child_ids=[r.request_id for r in core_requests],
            stream=RequestStream(request_id, self),
            arrival_time=arrival,
            num_outputs=len(core_requests),
            prompt_token_ids=list(core_requests[0].prompt_token_ids),
            prompt_text=prompt_text,
            params=core_requests[0].sampling_params,
            max_tokens=core_requests[0].sampling_params.max_tokens,
            lora_name=None if core_requests[0].lora_request is None else core_requests[0].lora_request.lora_name,
            trace_headers=current_trace_headers(),
        )
        self.output_processor.add_request(prompt_text, core_requests)
        self._requests[request_id] = state
        for child_id in state.child_ids:
            self._child_to_parent[child_id] = request_id
        return state

    async def generate(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative ``RequestOutput``s of one request until it finishes (with the LoRA
        adapter ``lora_request``, if given; ``priority`` as in ``add_request``).

        Bad input raises ``ValueError`` before the first output. Cancelling the consuming
        task (or closing this generator early) aborts the request and frees its blocks.
        """
        stream = await self.add_request(prompt, params, request_id, lora_request=lora_request, priority=priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def beam_search(
        self,
        prompts: Sequence[str | list[int] | dict],
        params: BeamSearchParams,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (``halserve.beam_search``) over ``prompts`` (with the adapter
        ``lora_request``, if given), in lockstep: each step submits one one-token request per
        live beam of every prompt, all at once. Bad input raises ``ValueError`` (a prompt the
        engine refuses: at the first step). Cancelling the caller aborts the step's requests."""
        from halserve.beam_search import BeamSearch
        from halserve.engine.async_beam_search import run_beam_searches

        self._check_alive()
        self.start()
        request_id = request_id or f"beam-{next(self._ids)}"
        info = self.model_info
        assert info is not None, "beam search needs the engine's model info"
        searches = []
        for prompt in prompts:
            if _prompt_size(prompt) > _INLINE_PROMPT_LIMIT:
                _, ids = await asyncio.get_running_loop().run_in_executor(
                    self.tokenizer_pool, self.input_processor.tokenize, prompt
                )
            else:
                _, ids = self.input_processor.tokenize(prompt)
            searches.append(BeamSearch(ids, params, info.eos_token_ids, info.max_model_len))
        return await run_beam_searches(self, searches, params, request_id, lora_request)

    async def run_in_engine(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(engine_core)`` in the engine thread (the only one that may touch the core), between
        steps; its result, or its exception raised here. In-process cores only: with an
        engine-core process, use ``call_core``."""
        self._check_alive()
        self.start()
        if not isinstance(self.client, EngineThread):
            raise RuntimeError("run_in_engine needs an in-process engine core; use call_core(method, *args)")
        return await self.client.call_fn(fn)

    async def call_core(self, method: str, *args: Any) -> Any:
        """``EngineCore.<method>(*args)`` between steps, wherever the core runs; its result, or
        its exception raised here."""
        self._check_alive()
        self.start()
        return await self.client.call(method, *args)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and validate a LoRA adapter on the workers (ValueError if it cannot be served)."""
        return await self.call_core("add_lora", lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return await self.call_core("remove_lora", lora_id)

    async def list_loras(self) -> set[int]:
        return await self.call_core("list_loras")

    # -- sleep mode and weight updates (vLLM's; EngineCore's, wherever it runs) ----------
    async def sleep(self, level: int = 1) -> None:
        await self.call_core("sleep", level)

    async def wake_up(self) -> None:
        await self.call_core("wake_up")

    async def is_sleeping(self) -> bool:
        return await self.call_core("is_sleeping")

    async def reset_prefix_cache(self) -> bool:
        return await self.call_core("reset_prefix_cache")

    async def update_weights(self, path: str) -> None:
        await self.call_core("update_weights", path)

    async def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict | None = None) -> list:
        """``Worker.<method>(*args, **kwargs)`` on every worker; one result per worker (a function
        ``method`` must pickle when the core runs in its own process)."""
        return await self.call_core("collective_rpc", method, tuple(args), kwargs)

    def abort(self, request_id: str) -> None:
        """Abort a request by its id (unknown or finished ids are ignored)."""
        state = self._drop(request_id, abort_core=True)
        if state is not None:
            self._record_finished(state, "abort")

    def _drop(self, request_id: str, abort_core: bool) -> RequestState | None:
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        state.stream.finished = True
        for child_id in state.child_ids:
            self._child_to_parent.pop(child_id, None)
        try:
            self.output_processor.abort_request(request_id)
        except Exception:  # noqa: BLE001 - the processor may already have dropped it
            logger.debug("output processor had no state for %s", request_id)
        if abort_core:
            self.client.abort(state.child_ids)
        return state

    def _finish_aborted(self, request_id: str) -> None:
        """End a stream with a final output whose finish_reason is "abort" (shutdown)."""
        state = self._requests.get(request_id)
        if state is None:
            return
        final = _aborted_output(state)
        stream = state.stream
        self._drop(request_id, abort_core=True)
        stream.finished = False  # let the consumer read the final output
        stream._put(final)
        self._record_finished(state, "abort")

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine died: {self.dead_error!r}") from self.dead_error
        if self._shutdown:
            raise EngineDeadError("the engine is shut down")

    # ------------------------------------------------------------------ asyncio side
    def _on_outputs(self, core_outputs: list[Any]) -> None:
        # Outputs of requests aborted meanwhile (the core had not seen the abort yet).
        live = [o for o in core_outputs if o.request_id in self._child_to_parent]
        if not live:
            return
        try:
            request_outputs, to_abort = self.output_processor.process_outputs(live)
        except Exception as exc:  # noqa: BLE001 - a detokenizer bug must not wedge streams
            logger.exception("output processing failed")
            self._on_dead(exc)
            return
        if to_abort:
            self.client.abort(to_abort)
        now = time.time()
        for out in request_outputs:
            state = self._requests.get(out.request_id)
            if state is None:
                continue
            self._record_tokens(state, out, now)
            state.last_output = out
            state.stream._put(out)
            if out.finished:
                self._requests.pop(out.request_id, None)
                for child_id in state.child_ids:
                    self._child_to_parent.pop(child_id, None)
                reason = next((o.finish_reason for o in out.outputs if o.finish_reason), "stop")
                self._record_finished(state, reason)

    def _record_tokens(self, state: RequestState, out: RequestOutput, now: float) -> None:
        total = sum(len(o.token_ids) for o in out.outputs)
        new = total - state.num_tokens
        if new <= 0:
            return
        state.num_tokens = total
        ttft = itl = None
        if state.first_token_time is None:
            state.first_token_time = now
            ttft = now - state.arrival_time
        else:
            itl = (now - (state.last_token_time or now)) / new
        state.last_token_time = now
        for observer in self.stat_observers:
            observer.on_new_tokens(new, ttft, itl)

    def _record_finished(self, state: RequestState, reason: str) -> None:
        now = time.time()
        e2e = now - state.arrival_time
        for observer in self.stat_observers:
            observer.on_request_finished(reason, e2e)
        observers = [o.on_request_stats for o in self.stat_observers if hasattr(o, "on_request_stats")]
        if not observers:
            return
        last = state.last_output
        metrics = last.metrics if last is not None else None
        stats = FinishedRequestStats(
            request_id=state.request_id,
            finish_reason=reason,
            num_prompt_tokens=len(state.prompt_token_ids),
            num_generation_tokens=state.num_tokens,
            num_cached_tokens=last.num_cached_tokens if last is not None else 0,
            params=state.params,
            n=state.num_outputs,
            max_tokens=state.max_tokens,
            lora_name=state.lora_name,
            arrival_time=state.arrival_time,
            first_scheduled_time=metrics.first_scheduled_time if metrics is not None else None,
            first_token_time=state.first_token_time,
            last_token_time=state.last_token_time,
            finished_time=now,
            prompt_text=state.prompt_text,
            trace_headers=state.trace_headers,
        )
        for on_request_stats in observers:
            try:
                on_request_stats(stats)
            except Exception:  # noqa: BLE001 - a log or trace exporter bug must not break the stream
                logger.exception("request stats observer failed")

    def _on_dead(self, exc: BaseException) -> None:
        if self.dead_error is None:
            self.dead_error = exc
        error = EngineDeadError(f"the engine died: {exc!r}")
        error.__cause__ = exc
        for request_id, state in list(self._requests.items()):
            self._requests.pop(request_id, None)
            state.stream._put(error)
        self._child_to_parent.clear()
        self.client.fail_pending(error)
        callbacks, self.death_callbacks = self.death_callbacks, []
        for callback in callbacks:
            try:
                callback(exc)
            except Exception:  # noqa: BLE001 - the others still run
                logger.exception("engine death callback failed")


def _prompt_size(prompt: Any) -> int:
    if isinstance(prompt, (str, list)):
        return len(prompt)
    if isinstance(prompt, dict):
        if prompt.get("multi_modal_data") is not None:
            return _INLINE_PROMPT_LIMIT + 1  # (image preprocessing: off the event loop)
        return max((len(v) for v in prompt.values() if isinstance(v, (str, list))), default=0)
    return 0


def _aborted_output(state: RequestState) -> RequestOutput:
    """The request's last output (or an empty one), finished with reason "abort"."""
    from halserve.outputs import CompletionOutput, RequestOutput

    last = state.last_output
    if last is not None:
        final = copy.copy(last)
        final.outputs = [copy.copy(o) for o in last.outputs]
    else:
        final = RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt_text,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[
                CompletionOutput(index=i, text="", token_ids=[], cumulative_logprob=None, logprobs=None)
                for i in range(state.num_outputs)
            ],
            finished=True,
        )
    for o in final.outputs:
        if o.finish_reason is None:
            o.finish_reason = "abort"
    final.finished = True
    return final
