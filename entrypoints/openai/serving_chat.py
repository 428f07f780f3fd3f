"""POST /v1/chat/completions: messages -> the chat template -> one engine request with
``n`` choices, streamed as ``chat.completion.chunk`` events or returned whole."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from halserve.engine.processor import check_text_length
from halserve.entrypoints.openai import serving_beam_search
from halserve.entrypoints.openai.chat_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ToolCall,
    ToolCallFunction,
)
from halserve.entrypoints.openai.constraints import constraint_messages, named_tool, tool_schema_error
from halserve.entrypoints.openai.errors import BadRequestError
from halserve.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs, token_decoder
from halserve.entrypoints.openai.protocol import (
    UsageInfo,
    random_id,
)
from halserve.entrypoints.openai.reasoning import ReplyStart
from halserve.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ClientDisconnected,
    OpenAIServing,
    error_event,
    sendable_end,
    sse_event,
)
from halserve.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser

if TYPE_CHECKING:  # pragma: no cover
    from halserve.engine.async_llm import RequestStream
    from halserve.outputs import CompletionOutput
    from halserve.sampling_params import SamplingParams
    from halserve.structured_output import StructuredOutputsParams

AUTO_TOOLS_NEED_A_PARSER = (
    "tool_choice 'auto' (the default with tools) needs the server started with "
    "--enable-auto-tool-choice --tool-call-parser NAME (the model's call format); or set "
    "tool_choice to 'required' or a named function (the call is generated to the tool's JSON schema)"
)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_template: str | None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    max_model_len: int | None = None,
) -> tuple[str, list[int]]:
    """Apply the chat template: ``(prompt text, prompt token ids)``. Template errors
    (e.g. a template that insists roles alternate) are the client's: ``ValueError``."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            "this model has no chat template, so /v1/chat/completions cannot build a prompt; "
            "start the server with --chat-template FILE or use /v1/completions"
        )
    try:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # noqa: BLE001 - jinja's raise_exception and friends
        raise ValueError(f"the chat template could not render these messages: {exc}") from None
    if max_model_len is not None:
        check_text_length(tokenizer, text, max_model_len)
    # The template writes the special tokens (BOS) itself.
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    return text, token_ids


async def load_images(urls: list[str], allowed_local_media_path: str | None, limit: int,
                      allowed_media_domains: list[str] | None = None) -> list[Any]:
    """The images ``urls`` name (``halserve.multimodal.media``), fetched concurrently; the first bad
    one is a 400 on ``messages`` saying which image it is and what is wrong with it."""
    from halserve.multimodal.media import load_image_async
    from halserve.multimodal.processing import too_many_images

    if len(urls) > limit:
        raise BadRequestError(too_many_images(len(urls), limit), param="messages")
    loads = [load_image_async(url, allowed_local_media_path=allowed_local_media_path,
                              allowed_media_domains=allowed_media_domains) for url in urls]
    results = await asyncio.gather(*loads, return_exceptions=True)
    for k, result in enumerate(results):
        if isinstance(result, ValueError):
            raise BadRequestError(f"image {k + 1} of {len(urls)}: {result}", param="messages")
        if isinstance(result, BaseException):
            raise result
    return results


@dataclass(slots=True)
class QueuedReply:
    """A chat request on the engine (``OpenAIServingChat.queue``)."""

    stream: RequestStream  # its outputs (all n choices)
    params: SamplingParams  # the sampling parameters it runs with
    start: ReplyStart | None  # where the reply starts with a reasoning parser (None: no parser)


class OpenAIServingChat:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def make_tool_parser(self, req: ChatCompletionRequest) -> ToolParser:
        """A parser of the server's --tool-call-parser format for one reply to ``req``."""
        assert self.serving.tool_parser is not None
        schemas = {tool.function.name: tool.function.parameters for tool in req.tools or ()}
        return get_tool_parser(self.serving.tool_parser)(schemas, None if req.parallel_tool_calls else 1)

    async def render(self, req: ChatCompletionRequest) -> tuple[str, list[int] | dict[str, Any]]:
        """``(prompt text, engine prompt)``: the template's token ids, or with images
        ``{"prompt_token_ids": ids, "multi_modal_data": {"image": [...]}}`` (the template writes one
        placeholder per image, in message order). Template and image errors are 400s on ``messages``."""
        serving = self.serving
        urls = req.image_urls()
        if urls and not serving.supports_images:
            where = req.first_image_param()
            raise BadRequestError(f"{where}: this model takes text only, so image_url content parts cannot be used; "
                                  "send text, or serve a vision-language model (e.g. LLaVA)", param=where)
        loop = asyncio.get_running_loop()
        try:
            text, ids = await loop.run_in_executor(
                serving.engine.tokenizer_pool,
                lambda: render_chat(
                    serving.tokenizer,
                    req.template_messages(),
                    serving.chat_template,
                    req.add_generation_prompt,
                    req.continue_final_message,
                    req.template_kwargs(),
                    # (a prompt to be truncated may be longer than the context: it is tokenized whole)
                    serving.max_model_len if req.truncate_prompt_tokens is None else None,
                ),
            )
        except ValueError as exc:
            raise BadRequestError(str(exc), param="messages") from None
        if not urls:
            return text, ids
        limit = serving.engine.model_info.max_images_per_prompt
        images = await load_images(urls, serving.allowed_local_media_path, limit, serving.allowed_media_domains)
        return text, {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}

    def check_tools(self, req: ChatCompletionRequest, no_parser_message: str = AUTO_TOOLS_NEED_A_PARSER) -> None:
        """tool_choice 'auto' needs the server's tool-call parser (a 400 saying ``no_parser_message``
        otherwise: the API's own words); a format whose markers are special tokens keeps them in
        the reply's text (skip_special_tokens false)."""
        if not req.auto_tools:
            return
        if self.serving.tool_parser is None:
            raise BadRequestError(no_parser_message, param="tool_choice")
        if req.skip_special_tokens is None and get_tool_parser(self.serving.tool_parser).needs_special_tokens:
            req.skip_special_tokens = False

    async def queue(self, req: ChatCompletionRequest, request_id: str, model: str,
                    message_params: dict[str, str | None], no_parser_message: str = AUTO_TOOLS_NEED_A_PARSER,
                    priority: int = 0, tool_schema_param: str = "tools[{i}].function.parameters") -> QueuedReply:
        """What every chat-shaped API (chat completions, Messages, Responses) does with its chat
        request: check the tools (``check_tools``), render the prompt, apply a constraint after
        the thinking, and queue one engine request (``message_params``: the API's names of the
        request's fields, for error messages; ``tool_schema_param``: its path to a tool's schema,
        named when a forced call's schema does not compile)."""
        serving = self.serving
        self.check_tools(req, no_parser_message)
        params = serving.sampling_params(req.sampling_kwargs(), message_params)
        prompt_text, prompt = await self.render(req)
        start = serving.reasoning_parser.reply_start(prompt_text) if serving.reasoning_parser else None
        if params.structured_outputs is not None:
            self.after_thinking(params.structured_outputs, start)
        try:
            (stream,) = await serving.add_requests([prompt], params, request_id, prompt_texts=[prompt_text],
                                                   lora_request=serving.lora_request(model),
                                                   message_params=message_params, priority=priority)
        except BadRequestError as exc:
            if req.calls_tools and exc.message.startswith("structured outputs: invalid"):
                raise tool_schema_error(req, tool_schema_param) or exc from None
            raise
        return QueuedReply(stream, params, start)

    def after_thinking(self, constraint: StructuredOutputsParams, start: ReplyStart | None) -> None:
        """A thinking model's constraint applies after its thinking: from the end tag on (the
        tag's tokens). Where the reply may or may not open with the start tag (one token), the
        first token is that tag or one the constraint allows."""
        serving = self.serving
        if start is ReplyStart.REASONING:
            constraint.start_after = list(serving.reasoning_end_ids)
        elif start is ReplyStart.MAYBE and len(serving.reasoning_start_ids) == 1:
            constraint.start_after = list(serving.reasoning_end_ids)
            constraint.opened_by = serving.reasoning_start_ids[0]

    def reply_parts(self, req: ChatCompletionRequest, text: str, start: ReplyStart | None, final: bool = True
                    ) -> tuple[str | None, str | None]:
        """``(reasoning, reply)`` of a reply's text (``final``: whole; while streaming, the parts of
        a growing text extend the previous parts): with a reasoning parser (``start`` set) the
        thinking and what follows it (``None`` while the reply has not got past its thinking);
        without, ``(None, text)``."""
        if start is None:
            return None, text
        return self.serving.reasoning_parser.split(text, start, final, exact=req.constrained)

    def reply_message(self, req: ChatCompletionRequest, output: CompletionOutput, start: ReplyStart | None
               ) -> tuple[ChatResponseMessage, str | None]:
        """The assistant's message and finish reason. With a reasoning parser (``start`` set) the
        thinking goes to ``reasoning`` and what follows it is the reply. With a forced tool
        choice that reply is the calls' JSON (generated to the tools' schemas): a named call cut
        short by max_tokens keeps its partial arguments, as OpenAI's do; a 'required' array cut
        short stays text. With tool_choice 'auto' the server's tool-call parser finds the calls."""
        finish = output.finish_reason
        reasoning, text = self.reply_parts(req, output.text, start)
        calls: list[tuple[str, str]] = []
        named = isinstance(req.tool_choice, dict) and req.calls_tools
        if text is None:
            pass  # (the reply never got past its reasoning)
        elif named:
            calls, text = [(named_tool(req).function.name, text)], None
        elif req.calls_tools:
            try:
                calls = [(call["name"], json.dumps(call["parameters"])) for call in json.loads(text)]
                text = None
            except ValueError:
                pass
        elif req.auto_tools:
            text, calls = self.make_tool_parser(req).parse(text)
        tool_calls = [ToolCall(function=ToolCallFunction(name=name, arguments=args)) for name, args in calls]
        if tool_calls and finish == "stop" and not named:
            finish = "tool_calls"  # (OpenAI says "stop" for a named function it was told to call)
        if not req.include_reasoning:
            reasoning = None
        message = ChatResponseMessage(content=text, reasoning=reasoning, reasoning_content=reasoning,
                                      tool_calls=tool_calls)
        return message, finish

    def _whole_reply(self, req: ChatCompletionRequest, output: CompletionOutput, start: ReplyStart | None,
                     top_n: int, decode: Any) -> ChatCompletionStreamChoice:
        """A streamed reply with tools, sent whole in its last delta: its text and its calls."""
        message, finish_reason = self.reply_message(req, output, start)
        calls = [DeltaToolCall(index=i, **call.model_dump()) for i, call in enumerate(message.tool_calls)]
        return ChatCompletionStreamChoice(
            index=output.index,
            delta=DeltaMessage(content=message.content, reasoning=message.reasoning,
                               reasoning_content=message.reasoning, tool_calls=calls),
            logprobs=chat_logprobs(output, 0, top_n, decode) if req.logprobs else None,
            finish_reason=finish_reason,
            stop_reason=output.stop_reason,
        )

    async def create(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        serving = self.serving
        model = serving.check_model(req.model)
        if req.use_beam_search:  # vLLM's extra: the n best beams as the choices
            if req.image_urls():  # (its one-token step requests carry token ids only)
                raise BadRequestError("use_beam_search cannot be used with images: beam search runs on token ids "
                                      "alone; leave use_beam_search out (greedy: temperature 0)",
                                      param="use_beam_search")
            return await serving_beam_search.create_chat_completion(self, req, raw_request, model)
        request_id = random_id("chatcmpl")
        queued = await self.queue(req, request_id, model, constraint_messages(req), priority=req.priority)
        start = queued.start
        created = int(time.time())
        top_n = req.top_logprobs or 0
        if req.stream:
            return StreamingResponse(
                self.stream_reply(req, queued.stream, request_id, model, created, top_n,
                                  queued.params.output_text_buffer_length, start),
                media_type="text/event-stream",
            )
        try:
            (final,) = await serving.collect([queued.stream], raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        decode = token_decoder(req, serving.decode_token)
        choices = []
        for o in final.outputs:
            message, finish_reason = self.reply_message(req, o, start)
            choices.append(ChatCompletionResponseChoice(
                index=o.index, message=message, logprobs=chat_logprobs(o, 0, top_n, decode),
                finish_reason=finish_reason, stop_reason=o.stop_reason,
            ))
        prompt_tokens = len(final.prompt_token_ids)
        completion_tokens = sum(len(o.token_ids) for o in final.outputs)
        response = ChatCompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
                prompt_tokens_details=serving.prompt_tokens_details([final]),
            ),
            prompt_logprobs=prompt_logprobs(final, decode) if req.prompt_logprobs is not None else None,
        )
        return JSONResponse(response.model_dump())

    async def stream_reply(
        self,
        req: ChatCompletionRequest,
        stream: RequestStream,
        request_id: str,
        model: str,
        created: int,
        top_n: int,
        holdback: int,
        start: ReplyStart | None,
    ) -> AsyncIterator[str]:
        decode = token_decoder(req, self.serving.decode_token)
        sent_text: dict[int, int] = {}  # per choice: how much of its text went out ...
        sent_parts: dict[int, tuple[int, int]] = {}  # ... or of its (reasoning, content), with a reasoning parser
        sent_tokens: dict[int, int] = {}
        finished: set[int] = set()
        usage = UsageInfo()
        # tool_choice 'auto': the parser streams each call's name, then its arguments, as they
        # are written; forced calls are known once the reply is whole (one delta at the end)
        tool_parsers: dict[int, ToolParser] = {}

        def chunk(choices: list[ChatCompletionStreamChoice]) -> str:
            return sse_event(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=choices))

        try:
            async for _, out in self.serving.merge([stream]):
                usage.prompt_tokens = len(out.prompt_token_ids)
                choices = []
                for o in out.outputs:
                    if o.index in finished:
                        continue
                    if o.index not in sent_text:
                        # The first chunk of each choice announces the role, as OpenAI does.
                        sent_text[o.index] = 0
                        announce = DeltaMessage(role="assistant", content="")
                        yield chunk([ChatCompletionStreamChoice(index=o.index, delta=announce)])
                    if req.calls_tools:
                        if o.finish_reason is not None:
                            finished.add(o.index)
                            choices.append(self._whole_reply(req, o, start, top_n, decode))
                        continue
                    start_tok = sent_tokens.get(o.index, 0)
                    final = o.finish_reason is not None
                    end = sendable_end(o.text, sent_text[o.index], final, holdback)
                    delta, thought = o.text[sent_text[o.index] : end], ""
                    if start is not None:
                        # (each split of the sendable text extends the previous one's parts)
                        reasoning, content = self.reply_parts(req, o.text[:end], start, final)
                        sent_r, sent_c = sent_parts.get(o.index, (0, 0))
                        thought, delta = (reasoning or "")[sent_r:], (content or "")[sent_c:]
                        sent_parts[o.index] = (sent_r + len(thought), sent_c + len(delta))
                        if not req.include_reasoning:
                            thought = ""
                    calls: list[DeltaToolCall] = []
                    finish_reason = o.finish_reason
                    if req.auto_tools:
                        if o.index not in tool_parsers:
                            tool_parsers[o.index] = self.make_tool_parser(req)
                        tool_parser = tool_parsers[o.index]
                        content = o.text[:end] if start is None else (content or "")
                        found = tool_parser.stream(content, final)
                        delta = found.content
                        calls = [DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                                               function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                                 for c in found.calls]
                        if final and finish_reason == "stop" and tool_parser.num_streamed_calls:
                            finish_reason = "tool_calls"
                    new_tokens = len(o.token_ids) > start_tok
                    if not (delta or thought or calls or final or (new_tokens and req.logprobs)):
                        continue
                    sent_text[o.index] = end
                    sent_tokens[o.index] = len(o.token_ids)
                    if final:
                        finished.add(o.index)
                    choices.append(
                        ChatCompletionStreamChoice(
                            index=o.index,
                            delta=DeltaMessage(content=delta if delta or not (thought or calls) else None,
                                               reasoning=thought or None, reasoning_content=thought or None,
                                               tool_calls=calls),
                            logprobs=chat_logprobs(o, start_tok, top_n, decode) if req.logprobs else None,
                            finish_reason=finish_reason,
                            stop_reason=o.stop_reason,
                        )
                    )
                usage.completion_tokens = sum(len(o.token_ids) for o in out.outputs)
                if choices:
                    yield chunk(choices)
            if req.include_usage:
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                yield sse_event(
                    ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[], usage=usage)
                )
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            yield error_event(exc)
        finally:
            stream.close()
        yield SSE_DONE
