"""What AsyncLLM hands its callers and keeps per request on the asyncio side: a request's
output stream (``RequestStream``), a request validated but not yet queued
(``PreparedRequest``), the metrics observer protocol with a finished request's figures
(``FinishedRequestStats``), and ``EngineDeadError``."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from halserve.engine.async_llm import AsyncLLM
    from halserve.engine.types import EngineCoreRequest
    from halserve.outputs import RequestOutput
    from halserve.sampling_params import SamplingParams

__all__ = ["EngineDeadError", "EngineStoppedError", "FinishedRequestObserver", "FinishedRequestStats",
           "PreparedRequest", "RequestState", "RequestStream", "StatsObserver"]


class EngineDeadError(RuntimeError):
    """The engine thread stopped (crashed or shut down); no request can make progress."""


class EngineStoppedError(EngineDeadError):
    """The engine-core process stopped on a signal (SIGTERM) and said so before it exited: an
    orderly stop, not a crash. The API server exits 0 when it is shutting down on a signal too
    (a signal to the whole process group); otherwise it is handled as the engine's death."""


class StatsObserver(Protocol):
    """Receives per-request timing and token counts (the server's Prometheus metrics)."""

    def on_request_added(self, num_prompt_tokens: int) -> None: ...

    def on_new_tokens(self, num_new_tokens: int, ttft: float | None, itl: float | None) -> None:
        """``ttft`` is set on a request's first tokens, ``itl`` (seconds per token since
        the previous update) on later ones."""

    def on_request_finished(self, finish_reason: str, e2e_latency: float) -> None: ...

    # (optional) default: absent. Called by ``AsyncLLM`` once per finished or aborted request, after
    # ``on_request_finished``, with every figure of it (request logs, traces, per-phase histograms).
    # def on_request_stats(self, stats: FinishedRequestStats) -> None: ...


class FinishedRequestObserver:
    """Base of the stats observers that read each request once, whole, when it finishes (the request
    log, the tracer): the per-token callbacks do nothing; a subclass implements ``on_request_stats``."""

    def on_request_added(self, num_prompt_tokens: int) -> None:
        pass

    def on_new_tokens(self, num_new_tokens: int, ttft: float | None, itl: float | None) -> None:
        pass

    def on_request_finished(self, finish_reason: str, e2e_latency: float) -> None:
        pass

    def on_request_stats(self, stats: FinishedRequestStats) -> None:
        raise NotImplementedError


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(0.0, end - start)


@dataclass(slots=True)
class FinishedRequestStats:
    """One finished (or aborted) request as the engine saw it. Times are ``time.time()`` seconds;
    a phase the request never reached (aborted while waiting: no scheduling, no token) is None.

        arrival --queue--> first scheduled --prefill--> first token --decode--> last token   finished
           |<------------------------------ e2e ----------------------------------------------->|
                           |<---------------------- inference ------------------>|
    """

    request_id: str
    finish_reason: str  # "stop" | "length" | "abort" (the first sample's that has one)
    num_prompt_tokens: int
    num_generation_tokens: int  # every sample's
    num_cached_tokens: int  # prompt tokens found in the prefix cache
    params: SamplingParams | None  # the first sample's (None: unknown)
    n: int  # samples asked for
    max_tokens: int | None  # as the request asked (None: up to the context length)
    lora_name: str | None  # its adapter; None: the base model
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float
    prompt_text: str | None  # None when it came as token ids
    trace_headers: dict[str, str] | None  # the W3C trace context it arrived with (traceparent, tracestate)

    @property
    def queue_time(self) -> float | None:
        return _span(self.arrival_time, self.first_scheduled_time)

    @property
    def ttft(self) -> float | None:
        return _span(self.arrival_time, self.first_token_time)

    @property
    def prefill_time(self) -> float | None:
        return _span(self.first_scheduled_time, self.first_token_time)

    @property
    def decode_time(self) -> float | None:
        return _span(self.first_token_time, self.last_token_time)

    @property
    def inference_time(self) -> float | None:
        return _span(self.first_scheduled_time, self.last_token_time)

    @property
    def e2e_time(self) -> float:
        return max(0.0, self.finished_time - self.arrival_time)


@dataclass(slots=True)
class RequestState:
    """Per parent request, asyncio side."""

    request_id: str
    child_ids: list[str]
    stream: RequestStream
    arrival_time: float
    num_outputs: int  # n
    num_tokens: int = 0  # generated so far, all samples
    first_token_time: float | None = None
    last_token_time: float | None = None
    last_output: RequestOutput | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_text: str | None = None
    params: SamplingParams | None = None  # the first sample's
    max_tokens: int | None = None  # as asked (params.max_tokens)
    lora_name: str | None = None
    trace_headers: dict[str, str] | None = None  # W3C trace context of the HTTP request that made it


@dataclass(slots=True)
class PreparedRequest:
    """A validated, tokenized request not yet queued (``AsyncLLM.prepare_request``)."""

    request_id: str
    prompt_text: str | None
    core_requests: list[EngineCoreRequest]
    arrival_time: float


class RequestStream:
    """The outputs of one request (cumulative ``RequestOutput``s), as an async iterator.

    Consecutive outputs the consumer has not picked up yet are coalesced (each is
    cumulative, the latest says everything). Closing it before the request finished
    (``aclose``, or cancelling the task that iterates it) aborts the request.
    """

    def __init__(self, request_id: str, engine: AsyncLLM) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not isinstance(item, BaseException) and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)
