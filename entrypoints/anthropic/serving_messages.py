"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat
pipeline (``OpenAIServingChat``: the chat template, images, sampling, the tool-call parser and
the reasoning parser), answered in Anthropic's shapes.

A streamed reply is Anthropic's event sequence::

    message_start
    content_block_start (thinking) ping  content_block_delta (thinking_delta)*  content_block_stop
    content_block_start (text)           content_block_delta (text_delta)*      content_block_stop
    content_block_start (tool_use)       content_block_delta (input_json_delta) content_block_stop  (per call)
    message_delta (stop_reason, stop_sequence, usage)
    message_stop

``ping`` follows the first block's start (or comes before message_delta if there is no block).
Thinking and text stream as they are generated. With tools the calls are known once the reply
is whole, so the text and the calls then come at the end, each call's input in one delta.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from halserve.entrypoints.anthropic.errors import anthropic_error_event
from halserve.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessagesBase,
    MessagesRequest,
    MessagesResponse,
    MessagesUsage,
    anthropic_id,
)
from halserve.entrypoints.openai.constraints import constraint_messages
from halserve.entrypoints.openai.errors import BadRequestError, OpenAIError
from halserve.entrypoints.openai.serving_chat import OpenAIServingChat, load_images, render_chat
from halserve.entrypoints.openai.serving_engine import ClientDisconnected, sendable_end

if TYPE_CHECKING:  # pragma: no cover
    from halserve.engine.async_llm import RequestStream
    from halserve.entrypoints.openai.chat_protocol import ChatCompletionRequest
    from halserve.entrypoints.openai.reasoning import ReplyStart
    from halserve.outputs import CompletionOutput

__all__ = ["AnthropicServingMessages"]

ABORTED = "the request was aborted before it finished (the server is shutting down); send it again"


def sse(kind: str, payload: dict[str, Any]) -> str:
    """One Anthropic SSE event: its type as the event name and in the data."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


def stop_reason_of(output: CompletionOutput, finish: str | None, has_calls: bool) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished reply."""
    if finish == "abort":
        raise OpenAIError(ABORTED, status_code=503)
    if finish == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(output.stop_reason, str):  # (a stop token id ends the turn like EOS)
        return "stop_sequence", output.stop_reason
    return "end_turn", None


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self.serving = chat.serving

    def _check(self, req: MessagesBase) -> ChatCompletionRequest:
        """The chat request, after the checks whose messages speak Anthropic's terms."""
        serving = self.serving
        serving.check_model(req.model)
        where = req.first_image_param()
        if where is not None and not serving.supports_images:
            raise BadRequestError(f"{where}: this model takes text only, so image blocks cannot be used; send text, "
                                  "or serve a vision-language model (e.g. LLaVA)", param=where)
        if req.wants_thinking and serving.reasoning_parser is None:
            raise BadRequestError("thinking needs a server started with --reasoning-parser NAME (the model's think "
                                  'format, e.g. qwen3); or leave thinking out or set {"type": "disabled"}',
                                  param="thinking")
        return req.to_chat_request()

    async def count_tokens(self, req: CountTokensRequest) -> CountTokensResponse:
        """The prompt's length as the engine sees it: the chat template's tokens, each image's
        placeholder expanded to the model's image tokens."""
        serving = self.serving
        chat_req = self._check(req)
        loop = asyncio.get_running_loop()
        try:
            _, ids = await loop.run_in_executor(
                serving.engine.tokenizer_pool,
                lambda: render_chat(serving.tokenizer, chat_req.template_messages(), serving.chat_template,
                                    template_kwargs=chat_req.template_kwargs()),
            )
        except ValueError as exc:
            raise BadRequestError(str(exc), param="messages") from None
        urls = chat_req.image_urls()
        if urls:
            limit = serving.engine.model_info.max_images_per_prompt
            images = await load_images(urls, serving.allowed_local_media_path, limit, serving.allowed_media_domains)
            processor = serving.engine.input_processor.mm_processor
            try:
                ids, _, _ = await loop.run_in_executor(serving.engine.tokenizer_pool,
                                                       lambda: processor.process(ids, {"image": images}))
            except ValueError as exc:
                raise BadRequestError(str(exc), param="messages") from None
        return CountTokensResponse(input_tokens=len(ids))

    async def create(self, req: MessagesRequest, raw_request: Request) -> Response:
        serving, chat = self.serving, self.chat
        chat_req = self._check(req)
        model = serving.check_model(req.model)
        if chat_req.auto_tools and serving.tool_parser is None:
            raise BadRequestError(
                'tools with tool_choice {"type": "auto"} (the default) need the server started with '
                "--enable-auto-tool-choice --tool-call-parser NAME (the model's call format); or set tool_choice to "
                '{"type": "any"} or {"type": "tool", "name": ...} (the call is generated to the tool\'s input_schema)',
                param="tool_choice",
            )
        params = serving.sampling_params(chat_req.sampling_kwargs())
        prompt_text, prompt = await chat.render(chat_req)
        start = serving.reasoning_parser.reply_start(prompt_text) if serving.reasoning_parser else None
        if params.structured_outputs is not None:
            chat.after_thinking(params.structured_outputs, start)
        message_id = anthropic_id("msg")
        (stream,) = await serving.add_requests([prompt], params, message_id, prompt_texts=[prompt_text],
                                               lora_request=serving.lora_request(model),
                                               message_params=constraint_messages(chat_req))
        if req.stream:
            return StreamingResponse(
                self.stream_reply(chat_req, stream, message_id, model, start, params.output_text_buffer_length),
                media_type="text/event-stream",
            )
        try:
            (final,) = await serving.collect([stream], raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        output = final.outputs[0]
        blocks, finish = self.reply_blocks(chat_req, output, start)
        stop_reason, stop_sequence = stop_reason_of(output, finish, any(b["type"] == "tool_use" for b in blocks))
        response = MessagesResponse(
            id=message_id, model=model, content=blocks, stop_reason=stop_reason, stop_sequence=stop_sequence,
            usage=MessagesUsage(input_tokens=len(final.prompt_token_ids), output_tokens=len(output.token_ids)),
        )
        return JSONResponse(response.model_dump())

    def reply_blocks(self, chat_req: ChatCompletionRequest, output: CompletionOutput, start: ReplyStart | None,
                     ) -> tuple[list[dict[str, Any]], str | None]:
        """The reply's content blocks (thinking, text, tool_use) and the chat finish reason."""
        message, finish = self.chat.reply_message(chat_req, output, start)
        blocks: list[dict[str, Any]] = []
        if message.reasoning:
            blocks.append({"type": "thinking", "thinking": message.reasoning, "signature": ""})
        return blocks + list(self._text_and_calls(message.content, message.tool_calls)), finish

    @staticmethod
    def _text_and_calls(text: str | None, tool_calls: list[Any]) -> Iterator[dict[str, Any]]:
        """A text block (unless empty) and a tool_use block per call. A call whose arguments are no
        JSON object (a named call cut short by max_tokens) stays text, as the model wrote it."""
        calls, kept = [], [text] if text else []
        for call in tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = None
            if isinstance(arguments, dict):
                calls.append({"type": "tool_use", "id": anthropic_id("toolu"), "name": call.function.name,
                              "input": arguments})
            else:
                kept.append(call.function.arguments)
        if kept:
            yield {"type": "text", "text": "".join(kept)}
        yield from calls

    async def stream_reply(self, chat_req: ChatCompletionRequest, stream: RequestStream, message_id: str, model: str,
                           start: ReplyStart | None, holdback: int) -> AsyncIterator[str]:
        parser = self.serving.reasoning_parser
        tools = chat_req.auto_tools or chat_req.calls_tools  # (the reply is parsed whole: text and calls at the end)
        sent_text = sent_reasoning = sent_content = 0
        block: list[Any] = [-1, None]  # [index of the open block, its type or None when closed]
        pinged = False
        started = False

        def open_block(content_block: dict[str, Any]) -> Iterator[str]:
            nonlocal pinged
            yield from close_block()
            block[0] += 1
            block[1] = content_block["type"]
            yield sse("content_block_start", {"index": block[0], "content_block": content_block})
            if not pinged:
                pinged = True
                yield sse("ping", {})

        def close_block() -> Iterator[str]:
            if block[1] is not None:
                yield sse("content_block_stop", {"index": block[0]})
                block[1] = None

        def delta(kind: str, body: dict[str, Any], content_block: dict[str, Any]) -> Iterator[str]:
            if block[1] != content_block["type"]:
                yield from open_block(content_block)
            yield sse("content_block_delta", {"index": block[0], "delta": {"type": kind, **body}})

        try:
            async for _, out in self.serving.merge([stream]):
                if not started:
                    started = True
                    usage = {"input_tokens": len(out.prompt_token_ids), "output_tokens": 0}
                    yield sse("message_start", {"message": {
                        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
                        "stop_reason": None, "stop_sequence": None, "usage": usage}})
                o = out.outputs[0]
                final = o.finish_reason is not None
                end = sendable_end(o.text, sent_text, final, holdback)
                thought, text = "", o.text[sent_text:end]
                if start is not None:
                    # (each split of the sendable text extends the previous one's parts)
                    reasoning, content = parser.split(o.text[:end], start, final, exact=chat_req.constrained)
                    thought, text = (reasoning or "")[sent_reasoning:], (content or "")[sent_content:]
                    sent_reasoning, sent_content = sent_reasoning + len(thought), sent_content + len(text)
                    if not chat_req.include_reasoning:
                        thought = ""
                sent_text = end
                if thought:
                    for event in delta("thinking_delta", {"thinking": thought},
                                       {"type": "thinking", "thinking": "", "signature": ""}):
                        yield event
                if text and not tools:
                    for event in delta("text_delta", {"text": text}, {"type": "text", "text": ""}):
                        yield event
                if not final:
                    continue
                finish = o.finish_reason
                has_calls = False
                if tools:
                    message, finish = self.chat.reply_message(chat_req, o, start)
                    for content_block in self._text_and_calls(message.content, message.tool_calls):
                        if content_block["type"] == "text":
                            for event in delta("text_delta", {"text": content_block["text"]},
                                               {"type": "text", "text": ""}):
                                yield event
                            continue
                        has_calls = True
                        arguments = json.dumps(content_block.pop("input"), ensure_ascii=False)
                        for event in open_block({**content_block, "input": {}}):
                            yield event
                        yield sse("content_block_delta", {"index": block[0], "delta": {
                            "type": "input_json_delta", "partial_json": arguments}})
                for event in close_block():
                    yield event
                stop_reason, stop_sequence = stop_reason_of(o, finish, has_calls)
                if not pinged:
                    yield sse("ping", {})
                yield sse("message_delta", {
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": {"input_tokens": len(out.prompt_token_ids), "output_tokens": len(o.token_ids)},
                })
                yield sse("message_stop", {})
                return
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            yield anthropic_error_event(exc)
        finally:
            stream.close()
