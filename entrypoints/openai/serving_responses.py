"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it): the request becomes a chat
request (``ResponsesRequest.chat_request``) and runs through the chat path's machinery (template
rendering and images, sampling parameters, reasoning parser, structured outputs after the thinking); its
reply comes back as output items (a ``reasoning`` item with --reasoning-parser, then a ``message``),
whole or streamed as the Responses API's semantic events. Nothing is stored.

A streamed response's events, each with the next ``sequence_number``::

    response.created, response.in_progress
    per output item (the reasoning, then the message):
        response.output_item.added, response.content_part.added,
        response.reasoning_text.delta / response.output_text.delta ...,
        response.reasoning_text.done / response.output_text.done,
        response.content_part.done, response.output_item.done
    per function call (with tools; after the message opened, if the reply has text):
        response.output_item.added (its call_id and name),
        response.function_call_arguments.delta ... (tool_choice 'auto': as the model writes them;
        a forced call: whole, at the end), response.function_call_arguments.done,
        response.output_item.done
    response.completed (as vLLM: also for a response whose status is "incomplete")

An error after the stream started is an ``error`` event, and the stream ends there.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from pydantic_core import to_jsonable_python

from halserve.engine.async_llm import EngineDeadError
from halserve.entrypoints.openai.constraints import constraint_messages
from halserve.entrypoints.openai.errors import BadRequestError, OpenAIError, validation_message
from halserve.entrypoints.openai.reasoning import ReplyStart
from halserve.entrypoints.openai.responses_protocol import (
    FunctionCallItem,
    IncompleteDetails,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
    item_id,
)
from halserve.entrypoints.openai.serving_chat import OpenAIServingChat
from halserve.entrypoints.openai.serving_engine import ClientDisconnected, OpenAIServing, sendable_end
from halserve.entrypoints.openai.tool_parsers import ToolParser

if TYPE_CHECKING:  # pragma: no cover
    from halserve.engine.async_llm import RequestStream
    from halserve.entrypoints.openai.chat_protocol import ChatCompletionRequest
    from halserve.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)

__all__ = ["OpenAIServingResponses"]

ItemKind = Literal["reasoning", "message"]


def _input_param(exc: BadRequestError) -> BadRequestError:
    """The chat path names the prompt ``messages`` (or ``prompt``): here it is the ``input``."""
    if exc.param in ("messages", "prompt"):
        exc.param = "input"
    return exc


def finished_status(finish_reason: str | None) -> tuple[str, IncompleteDetails | None]:
    """A response's status and incomplete_details from its output's finish reason."""
    if finish_reason == "length":
        return "incomplete", IncompleteDetails(reason="max_output_tokens")
    if finish_reason == "abort":  # (the server is shutting down)
        return "cancelled", None
    return "completed", None


def last_item_status(finish_reason: str | None) -> str:
    """The status of the item the output ended in (the items before it are completed)."""
    return "completed" if finished_status(finish_reason)[0] == "completed" else "incomplete"


def output_item(kind: ItemKind, item_id_: str, text: str | None, status: str) -> ReasoningItem | OutputMessage:
    """An output item holding ``text`` (``None``: just opened, no content part yet)."""
    if kind == "reasoning":
        content = None if text is None else [ReasoningText(text=text)]
        return ReasoningItem(id=item_id_, content=content, status=status)
    return OutputMessage(id=item_id_, content=[] if text is None else [OutputText(text=text)], status=status)


class EventWriter:
    """Server-sent events of one streamed response, numbered in order."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, type_: str, **fields: Any) -> str:
        payload = to_jsonable_python({"type": type_, "sequence_number": self.sequence_number, **fields},
                                     by_alias=True)
        self.sequence_number += 1
        return f"event: {type_}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class StreamedItem:
    """One output item while it streams: from ``output_item.added`` to ``output_item.done``."""

    # kind -> its text's delta and done events
    TEXT_EVENTS = {"reasoning": "response.reasoning_text", "message": "response.output_text"}

    def __init__(self, kind: ItemKind, output_index: int, emit: EventWriter) -> None:
        self.kind = kind
        self.id = item_id("rs" if kind == "reasoning" else "msg")
        self.output_index = output_index
        self.text = ""
        self.emit = emit
        self.done: ReasoningItem | OutputMessage | None = None  # the item as finished

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.id, "output_index": self.output_index, "content_index": 0}

    def _part(self, text: str) -> OutputText | ReasoningText:
        return OutputText(text=text) if self.kind == "message" else ReasoningText(text=text)

    def _text_fields(self) -> dict[str, Any]:
        return {"logprobs": []} if self.kind == "message" else {}  # (output text events require logprobs)

    def open(self) -> Iterator[str]:
        yield self.emit("response.output_item.added", output_index=self.output_index,
                        item=output_item(self.kind, self.id, None, "in_progress"))
        yield self.emit("response.content_part.added", **self._where(), part=self._part(""))

    def extend(self, text: str) -> Iterator[str]:
        """Events for the text so far (it extends what was sent)."""
        delta = text[len(self.text):]
        if delta:
            self.text = text
            yield self.emit(f"{self.TEXT_EVENTS[self.kind]}.delta", **self._where(), delta=delta,
                            **self._text_fields())

    def close(self, status: str) -> Iterator[str]:
        yield self.emit(f"{self.TEXT_EVENTS[self.kind]}.done", **self._where(), text=self.text, **self._text_fields())
        yield self.emit("response.content_part.done", **self._where(), part=self._part(self.text))
        self.done = output_item(self.kind, self.id, self.text, status)
        yield self.emit("response.output_item.done", output_index=self.output_index, item=self.done)


class StreamedCall:
    """One function call while it streams: from ``output_item.added`` to ``output_item.done``."""

    def __init__(self, name: str, output_index: int, emit: EventWriter) -> None:
        self.id, self.call_id = item_id("fc"), item_id("call")
        self.name = name
        self.output_index = output_index
        self.arguments = ""
        self.emit = emit
        self.done: FunctionCallItem | None = None

    def item(self, status: str) -> FunctionCallItem:
        return FunctionCallItem(id=self.id, call_id=self.call_id, name=self.name, arguments=self.arguments,
                                status=status)

    def open(self) -> Iterator[str]:
        yield self.emit("response.output_item.added", output_index=self.output_index, item=self.item("in_progress"))

    def extend(self, delta: str) -> Iterator[str]:
        if delta:
            self.arguments += delta
            yield self.emit("response.function_call_arguments.delta", item_id=self.id,
                            output_index=self.output_index, delta=delta)

    def close(self, status: str) -> Iterator[str]:
        yield self.emit("response.function_call_arguments.done", item_id=self.id, output_index=self.output_index,
                        name=self.name, arguments=self.arguments)
        self.done = self.item(status)
        yield self.emit("response.output_item.done", output_index=self.output_index, item=self.done)


class OpenAIServingResponses:
    def __init__(self, serving: OpenAIServing, chat: OpenAIServingChat) -> None:
        self.serving = serving
        self.chat = chat

    async def create(self, req: ResponsesRequest, raw_request: Request) -> Response:
        serving = self.serving
        model = serving.check_model(req.model)
        try:
            chat_req = req.chat_request()
        except ValidationError as exc:  # (what the chat request checks beyond this one's own checks)
            message, param = validation_message(exc.errors(include_url=False))
            raise BadRequestError(message, param=param) from None
        if (where := req.first_image_param()) is not None and not serving.supports_images:
            raise BadRequestError(f"{where}: this model takes text only, so input_image content parts cannot be "
                                  "used; send text, or serve a vision-language model (e.g. LLaVA)", param=where)
        response_id = item_id("resp")
        try:
            # (the chat request's response_format is this request's text.format)
            renamed = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens"}
            message_params = {prefix: renamed.get(name, name) for prefix, name in constraint_messages(chat_req).items()}
            queued = await self.chat.queue(chat_req, response_id, model, message_params,
                                           tool_schema_param="tools[{i}].parameters")
        except BadRequestError as exc:
            raise _input_param(exc) from None
        stream, params, start = queued.stream, queued.params, queued.start
        head = ResponsesResponse.in_progress(req, response_id, model, int(time.time()), params.temperature,
                                             params.top_p)
        if req.stream:
            return StreamingResponse(
                self.stream_reply(chat_req, stream, head, params.output_text_buffer_length, start),
                media_type="text/event-stream",
            )
        try:
            (final,) = await serving.collect([stream], raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        (output,) = final.outputs
        message, _ = self.chat.reply_message(chat_req, output, start)
        last_status = last_item_status(output.finish_reason)
        items = []
        if message.reasoning is not None:
            status = "completed" if message.content is not None else last_status
            items.append(output_item("reasoning", item_id("rs"), message.reasoning, status))
        if message.content is not None:
            items.append(output_item("message", item_id("msg"), message.content, last_status))
        for call in message.tool_calls:
            items.append(FunctionCallItem(id=item_id("fc"), call_id=item_id("call"), name=call.function.name,
                                          arguments=call.function.arguments, status=last_status))
        response = self._finished(head, final, items, message.reasoning)
        return JSONResponse(response.model_dump(mode="json", by_alias=True))

    def _finished(self, head: ResponsesResponse, final: RequestOutput,
                  items: list[ReasoningItem | OutputMessage | FunctionCallItem],
                  reasoning: str | None) -> ResponsesResponse:
        """The response once its output is whole: status, output items and usage."""
        (output,) = final.outputs
        status, incomplete = finished_status(output.finish_reason)
        num_input, num_output = len(final.prompt_token_ids), len(output.token_ids)
        usage = ResponseUsage(
            input_tokens=num_input,
            input_tokens_details={"cached_tokens": final.num_cached_tokens},
            output_tokens=num_output,
            output_tokens_details={"reasoning_tokens": self._num_reasoning_tokens(output, reasoning)},
            total_tokens=num_input + num_output,
        )
        return head.model_copy(update={"status": status, "incomplete_details": incomplete, "output": items,
                                       "usage": usage, "completed_at": int(time.time())})

    def _num_reasoning_tokens(self, output: CompletionOutput, reasoning: str | None) -> int:
        """Generated tokens up to the end of the thinking, its end tag included (all of them when
        the reply never left it)."""
        if reasoning is None:
            return 0
        end_ids, token_ids = self.serving.reasoning_end_ids, output.token_ids
        for i in range(len(token_ids) - len(end_ids) + 1):
            if token_ids[i : i + len(end_ids)] == end_ids:
                return i + len(end_ids)
        return len(token_ids)

    async def stream_reply(
        self,
        chat_req: ChatCompletionRequest,
        stream: RequestStream,
        head: ResponsesResponse,
        holdback: int,
        start: ReplyStart | None,
    ) -> AsyncIterator[str]:
        emit = EventWriter()
        items: dict[ItemKind, StreamedItem] = {}
        calls: list[StreamedCall] = []
        tool_parser: ToolParser | None = self.chat.make_tool_parser(chat_req) if chat_req.auto_tools else None
        message_text = ""  # with tools: the content the tool parser let through
        sent = 0  # how much of the generated text went out
        try:
            yield emit("response.created", response=head)
            yield emit("response.in_progress", response=head)
            final = None
            async for out in stream:
                (o,) = out.outputs
                is_final = o.finish_reason is not None
                sent = sendable_end(o.text, sent, is_final, holdback)
                text = o.text[:sent]
                # (each split of the sendable text extends the previous one's parts)
                reasoning, content = self.chat.reply_parts(chat_req, text, start, is_final)
                found = None
                if chat_req.calls_tools:  # (forced calls are known once the reply is whole)
                    content = None
                elif tool_parser is not None and content is not None:
                    found = tool_parser.stream(content, is_final)
                    message_text += found.content
                    content = message_text if message_text or not tool_parser.num_streamed_calls else None
                for event in self._advance(items, emit, reasoning, content, is_final, len(calls)):
                    yield event
                for piece in found.calls if found is not None else ():
                    if piece.index == len(calls):
                        calls.append(StreamedCall(piece.name or "", len(items) + len(calls), emit))
                        for event in calls[-1].open():
                            yield event
                    for event in calls[piece.index].extend(piece.arguments):
                        yield event
                final = out
            assert final is not None
            status = last_item_status(final.outputs[0].finish_reason)
            if chat_req.calls_tools:
                message, _ = self.chat.reply_message(chat_req, final.outputs[0], start)
                for event in self._advance(items, emit, message.reasoning, message.content, True, len(calls)):
                    yield event
                for call in message.tool_calls:
                    calls.append(StreamedCall(call.function.name, len(items) + len(calls), emit))
                    for event in calls[-1].open():
                        yield event
                    for event in calls[-1].extend(call.function.arguments):
                        yield event
            for item in items.values():
                if item.done is None:
                    for event in item.close(status):
                        yield event
            for call in calls:
                for event in call.close(status):
                    yield event
            finished = [(item.output_index, item.done) for item in [*items.values(), *calls]]
            done = [item for _, item in sorted(finished, key=lambda pair: pair[0]) if item is not None]
            response = self._finished(head, final, done, items["reasoning"].text if "reasoning" in items else None)
            yield emit("response.completed", response=response)
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            yield emit("error", **_error_fields(exc))
        finally:
            stream.close()  # (a client that went away cancels this generator: the request is aborted)

    @staticmethod
    def _advance(items: dict[ItemKind, StreamedItem], emit: EventWriter, reasoning: str | None,
                 content: str | None, is_final: bool, num_calls: int = 0) -> Iterator[str]:
        """Events for the reply's parts so far: the reasoning item's, then (closing the reasoning) the
        message's. A message opens once it has text, or at the end if the reply has content at all.
        (``num_calls`` function call items have output indexes already.)"""
        if reasoning:
            if "reasoning" not in items:
                items["reasoning"] = StreamedItem("reasoning", len(items) + num_calls, emit)
                yield from items["reasoning"].open()
            yield from items["reasoning"].extend(reasoning)
        if content or (content is not None and is_final):
            if "message" not in items:
                if "reasoning" in items:
                    yield from items["reasoning"].close("completed")
                items["message"] = StreamedItem("message", len(items) + num_calls, emit)
                yield from items["message"].open()
            yield from items["message"].extend(content)


def _error_fields(exc: BaseException) -> dict[str, Any]:
    """An ``error`` event's fields (code, message, param) for an error raised mid-stream."""
    if isinstance(exc, EngineDeadError):
        exc = OpenAIError(str(exc), status_code=503, code="engine_dead")
    if not isinstance(exc, OpenAIError):
        logger.exception("error while streaming a response", exc_info=exc)
        exc = OpenAIError(f"internal server error: {type(exc).__name__}: {exc}", status_code=500)
    error = exc.body()["error"]
    return {"code": error["code"] or error["type"], "message": error["message"], "param": error["param"]}
