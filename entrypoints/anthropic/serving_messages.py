"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat
pipeline (``OpenAIServingChat``: the chat template, images, sampling, the tool-call parser and
the reasoning parser), answered in Anthropic's shapes.

A streamed reply is Anthropic's event sequence (``streaming``).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from halserve.entrypoints.anthropic.blocks import THINKING_BLOCK, ReplyItem, content_blocks
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
from halserve.entrypoints.anthropic.streaming import MessageEvents, stop_reason_of
from halserve.entrypoints.openai.constraints import constraint_messages
from halserve.entrypoints.openai.errors import BadRequestError
from halserve.entrypoints.openai.serving_chat import OpenAIServingChat, load_images, render_chat
from halserve.entrypoints.openai.serving_engine import ClientDisconnected

if TYPE_CHECKING:  # pragma: no cover
    from halserve.engine.async_llm import RequestStream
    from halserve.entrypoints.openai.chat_protocol import ChatCompletionRequest
    from halserve.entrypoints.openai.reasoning import ReplyStart
    from halserve.outputs import CompletionOutput

__all__ = ["AnthropicServingMessages"]

AUTO_TOOLS_NEED_A_PARSER = (
    'tools with tool_choice {"type": "auto"} (the default) need the server started with '
    "--enable-auto-tool-choice --tool-call-parser NAME (the model's call format); or set tool_choice to "
    '{"type": "any"} or {"type": "tool", "name": ...} (the call is generated to the tool\'s input_schema)'
)


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
        message_id = anthropic_id("msg")
        queued = await chat.queue(chat_req, message_id, model, constraint_messages(chat_req), AUTO_TOOLS_NEED_A_PARSER,
                                  tool_schema_param="tools[{i}].input_schema")
        start = queued.start
        if req.stream:
            return StreamingResponse(
                self.stream_reply(chat_req, queued.stream, message_id, model, start,
                                  queued.params.output_text_buffer_length),
                media_type="text/event-stream",
            )
        try:
            (final,) = await serving.collect([queued.stream], raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        output = final.outputs[0]
        blocks = self.reply_blocks(chat_req, output, start)
        has_calls = any(b["type"] == "tool_use" for b in blocks)
        stop_reason, stop_sequence = stop_reason_of(output, output.finish_reason, has_calls)
        response = MessagesResponse(
            id=message_id, model=model, content=blocks, stop_reason=stop_reason, stop_sequence=stop_sequence,
            usage=MessagesUsage(input_tokens=len(final.prompt_token_ids), output_tokens=len(output.token_ids)),
        )
        return JSONResponse(response.model_dump())

    def reply_items(self, chat_req: ChatCompletionRequest, output: CompletionOutput, start: ReplyStart | None,
                    ) -> tuple[str | None, list[ReplyItem]]:
        """A whole reply's thinking (``None``: none, or left out) and its text and calls in order."""
        if not chat_req.auto_tools:  # (no tools, or forced calls: the reply is text, or calls only)
            message, _ = self.chat.reply_message(chat_req, output, start)
            calls = [(call.function.name, call.function.arguments) for call in message.tool_calls]
            return message.reasoning, [*([message.content] if message.content else []), *calls]
        reasoning, text = self.chat.reply_parts(chat_req, output.text, start)
        items = [] if text is None else self.chat.make_tool_parser(chat_req).parse_items(text)
        if not any(isinstance(item, tuple) for item in items):
            items = [text] if text else []  # (no call: the text as generated)
        return reasoning if chat_req.include_reasoning else None, items

    def reply_blocks(self, chat_req: ChatCompletionRequest, output: CompletionOutput, start: ReplyStart | None,
                     ) -> list[dict[str, Any]]:
        """The reply's content blocks: thinking, then text and tool_use in the order written."""
        reasoning, items = self.reply_items(chat_req, output, start)
        thinking = [{**THINKING_BLOCK, "thinking": reasoning}] if reasoning else []
        return thinking + content_blocks(items)

    def message_events(self, chat_req: ChatCompletionRequest, start: ReplyStart | None, holdback: int
                       ) -> MessageEvents:
        """The event writer of one streamed reply to ``chat_req``."""
        tool_parser = self.chat.make_tool_parser(chat_req) if chat_req.auto_tools else None
        return MessageEvents(chat_req, lambda text, final: self.chat.reply_parts(chat_req, text, start, final),
                             tool_parser, lambda output: self.reply_items(chat_req, output, start)[1], holdback)

    async def stream_reply(self, chat_req: ChatCompletionRequest, stream: RequestStream, message_id: str, model: str,
                           start: ReplyStart | None, holdback: int) -> AsyncIterator[str]:
        events = self.message_events(chat_req, start, holdback)
        started = False
        try:
            async for _, out in self.serving.merge([stream]):
                if not started:
                    started = True
                    yield events.start(message_id, model, len(out.prompt_token_ids))
                for event in events.feed(out.outputs[0], len(out.prompt_token_ids)):
                    yield event
                if out.outputs[0].finish_reason is not None:
                    return
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            yield anthropic_error_event(exc)
        finally:
            stream.close()
