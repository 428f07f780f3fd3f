"""What every endpoint shares: served model names, turning a request into sampling
params and engine requests, waiting for results while watching for a client that went
away, and the SSE framing."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from fastapi import Request

from halserve.engine.async_llm import EngineDeadError, RequestStream
from halserve.engine.core import EngineSleepingError
from halserve.entrypoints.openai.errors import BadRequestError, NotFoundError, OpenAIError
from halserve.entrypoints.openai.reasoning import get_reasoning_parser
from halserve.entrypoints.openai.serving_lora import LoRAModules

if TYPE_CHECKING:  # pragma: no cover
    from halserve.engine.async_llm import AsyncLLM
    from halserve.lora.request import LoRARequest
    from halserve.outputs import RequestOutput
    from halserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["ClientDisconnected", "OpenAIServing", "sendable_end", "sse_event", "SSE_DONE"]

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: Any) -> str:
    """One server-sent event carrying ``payload`` (a pydantic model or a dict) as JSON."""
    if hasattr(payload, "model_dump_json"):
        data = payload.model_dump_json(exclude_unset=False)
    else:
        data = json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


class OpenAIServing:
    """Shared state and helpers of the endpoint handlers."""

    def __init__(
        self,
        engine: AsyncLLM,
        served_model_names: Sequence[str],
        model_path: str,
        chat_template: str | None = None,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        lora_modules: LoRAModules | None = None,
        allowed_local_media_path: str | None = None,
        allowed_media_domains: list[str] | None = None,
        enable_prompt_tokens_details: bool = False,
    ) -> None:
        if not served_model_names:
            raise ValueError("at least one served model name is needed")
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.model_path = model_path
        self.chat_template = chat_template
        self.tool_parser = tool_parser  # tool_choice 'auto': the --tool-call-parser, None when not enabled
        # usage reports prompt_tokens_details.cached_tokens (prefix cache and KV connector hits), vLLM's flag
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.tokenizer = engine.tokenizer
        self.reasoning_parser = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        # the token ids of its tags: a constrained reply's grammar starts after the end tag's
        self.reasoning_start_ids, self.reasoning_end_ids = (
            [self.tokenizer.encode(tag, add_special_tokens=False) for tag in (parser.start_tag, parser.end_tag)]
            if (parser := self.reasoning_parser) else (None, None)
        )
        self.created = int(time.time())
        self.lora_modules = lora_modules or LoRAModules()  # adapters served by name (after the base model)
        # --allowed-local-media-path: the directory file:// image URLs may read from; None: no file:// URLs
        self.allowed_local_media_path = allowed_local_media_path
        self.allowed_media_domains = allowed_media_domains  # hosts http(s) image URLs may name; None: any

    @property
    def max_model_len(self) -> int | None:
        info = self.engine.model_info
        return getattr(info, "max_model_len", None)

    @property
    def supports_images(self) -> bool:
        """Whether the model reads images (a vision-language model); unknown: True (the engine decides)."""
        return bool(getattr(self.engine.model_info, "is_multimodal", True))

    @property
    def vocab_size(self) -> int | None:
        info = self.engine.model_info
        size = getattr(info, "vocab_size", None)
        return size if size is not None else (len(self.tokenizer) if self.tokenizer is not None else None)

    # ------------------------------------------------------------------ validation
    def check_model(self, name: str | None) -> str:
        """The served name a request addresses; an unknown name is a 404."""
        if name is None or name == "":
            return self.served_model_names[0]
        if name in self.served_model_names or name in self.lora_modules:
            return name
        names = [*self.served_model_names, *(lora.lora_name for lora in self.lora_modules.values())]
        raise NotFoundError(
            f"The model `{name}` does not exist. Served models: {', '.join(names)}",
            param="model",
            code="model_not_found",
        )

    def lora_request(self, model: str) -> LoRARequest | None:
        """The adapter a (checked) model name selects; None for the base model."""
        return self.lora_modules.get(model)

    def sampling_params(self, kwargs: dict[str, Any],
                        message_params: dict[str, str | None] | None = None) -> SamplingParams:
        """SamplingParams of a request's fields; an invalid one is a 400 whose ``param`` is the
        field its message starts with (``message_params``: as ``add_requests``')."""
        from halserve.sampling_params import SamplingParams

        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as exc:
            message = str(exc)
            field = message.split(" ", 1)[0].split("=", 1)[0].rstrip(":")  # (its messages start with the field)
            param = next((name for prefix, name in (message_params or {}).items() if message.startswith(prefix)),
                         field if field in kwargs else None)
            raise BadRequestError(message, param=param) from None

    # ------------------------------------------------------------------ engine calls
    async def add_requests(
        self,
        prompts: Sequence[Any],
        params: SamplingParams,
        request_id: str,
        prompt_texts: Sequence[str | None] | None = None,
        lora_request: LoRARequest | None = None,
        message_params: dict[str, str | None] | None = None,
        prompt_params: Sequence[str] | None = None,
        raw_request: Request | None = None,
        priority: int = 0,
    ) -> list[RequestStream]:
        """Queue one engine request per prompt. Every prompt is checked before any is queued:
        an invalid one is a 400 and nothing runs (nor when the engine refuses one as they are
        queued, all in one round trip, e.g. one that can never fit in the KV cache). The 400's ``param`` is the
        sampling field its message starts with, or ``message_params[prefix]`` for a message that
        starts with ``prefix`` (e.g. "structured outputs" -> the field that gave the constraint).
        ``prompt_params``: the request field each prompt came from (e.g. "documents[2]"); an error
        about a prompt, not a sampling field, then names it as the 400's param and message prefix.
        With ``raw_request``, a client gone before a batch is all queued stops it there
        (``ClientDisconnected``; what was queued is aborted)."""
        streams: list[RequestStream] = []
        done = 0  # prompts prepared, then prompts queued
        watch = asyncio.ensure_future(wait_disconnect(raw_request)) if raw_request and len(prompts) > 1 else None
        prepared: list = []
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                text = prompt_texts[i] if prompt_texts is not None else None
                prepared.append(await self.engine.prepare_request(prompt, params.clone(), rid, prompt_text=text,
                                                                  lora_request=lora_request, priority=priority))
                done += 1
                if len(prompts) > 1:
                    await asyncio.sleep(0)  # (a batch of short prompts checked inline: let the loop breathe)
                if watch is not None and watch.done():
                    raise ClientDisconnected
            done = 0
            try:  # (one engine round trip for the whole batch: all queued, or none)
                streams.extend(await self.engine.submit_all(prepared))
            except ValueError as exc:
                done = getattr(exc, "batch_index", 0)  # (the prompt the engine refused)
                raise
            if watch is not None:
                watch.cancel()
                if watch.done() and not watch.cancelled():  # (it saw the disconnect as it was cancelled)
                    raise ClientDisconnected
        except BaseException as exc:
            if watch is not None:
                watch.cancel()
            for stream in streams:
                stream.close()
            if len(prepared) > 64:  # (a big batch refused: its token ids are freed off the event loop)
                from halserve.entrypoints.openai.offload import release_in_thread

                release_in_thread(prepared)
            if isinstance(exc, EngineSleepingError):  # (not the request's fault: 503, try again after /wake_up)
                raise OpenAIError(str(exc), status_code=503, code="engine_sleeping") from None
            if isinstance(exc, ValueError):
                from halserve.sampling_params import FIELD_NAMES

                param = "prompt" if len(prompts) == 1 else f"prompt[{done}]"
                field = str(exc).split(" ", 1)[0].split("=", 1)[0]  # (a message about a field starts with it)
                param = (field if field.split(".", 1)[0] in FIELD_NAMES  # (e.g. structured_outputs.opened_by)
                         else param if "prompt" in str(exc).lower() else None)
                message = str(exc)
                if prompt_params is not None and field.split(".", 1)[0] not in FIELD_NAMES:
                    param = prompt_params[done]
                    message = f"{param}: {message}"
                param = next((name for prefix, name in (message_params or {}).items()
                              if str(exc).startswith(prefix)), "priority" if str(exc).startswith("priority") else param)
                raise BadRequestError(message, param=param) from None
            if isinstance(exc, EngineDeadError):
                raise OpenAIError(str(exc), status_code=503, code="engine_dead") from None
            raise
        return streams

    def prompt_tokens_details(self, finals: Sequence[RequestOutput]) -> dict[str, int] | None:
        """``{"cached_tokens": n}`` of these prompts' outputs with --enable-prompt-tokens-details; else None."""
        if not self.enable_prompt_tokens_details:
            return None
        return {"cached_tokens": sum(final.num_cached_tokens or 0 for final in finals)}

    async def collect(self, streams: list[RequestStream], raw_request: Request | None) -> list[RequestOutput]:
        """Wait for every stream's final output. If the client disconnects first, abort
        them all and raise ``ClientDisconnected``."""

        async def last(stream: RequestStream) -> RequestOutput:
            final = None
            async for out in stream:
                final = out
            assert final is not None
            return final

        work = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
        watch = asyncio.ensure_future(wait_disconnect(raw_request)) if raw_request is not None else None
        try:
            waiting = {work} if watch is None else {work, watch}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                try:
                    return work.result()
                except EngineDeadError as exc:
                    raise OpenAIError(str(exc), status_code=503, code="engine_dead") from None
            raise ClientDisconnected()
        finally:
            if watch is not None:
                watch.cancel()
            if not work.done():
                work.cancel()
                with suppress(BaseException):
                    await work
            for stream in streams:
                stream.close()

    async def merge(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several streams as they come: ``(stream index, output)``."""
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        pending: dict[asyncio.Future, int] = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    try:
                        out = fut.result()
                    except StopAsyncIteration:
                        continue
                    pending[asyncio.ensure_future(streams[i].__anext__())] = i
                    yield i, out
        finally:
            for fut in pending:
                fut.cancel()

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


async def wait_disconnect(request: Request) -> None:
    """Return once the client has gone away (the ASGI ``http.disconnect`` message)."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


def sendable_end(text: str, sent: int, finished: bool, holdback: int) -> int:
    """How far into ``text`` a stream may send: all of it once finished; otherwise keep
    the last ``holdback`` characters, which could still turn into a stop string and be
    cut (``SamplingParams.output_text_buffer_length``)."""
    if finished or holdback == 0:
        return len(text)
    return max(sent, len(text) - holdback)


def error_event(exc: BaseException) -> str:
    """The SSE event for an error raised after the stream started."""
    if isinstance(exc, OpenAIError):
        return sse_event(exc.body())
    if isinstance(exc, EngineDeadError):
        return sse_event(OpenAIError(str(exc), status_code=503, code="engine_dead").body())
    logger.exception("error while streaming", exc_info=exc)
    return sse_event(OpenAIError(f"internal server error: {type(exc).__name__}: {exc}", status_code=500).body())
