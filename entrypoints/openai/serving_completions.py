"""POST /v1/completions: one engine request per prompt, ``n`` choices each
(choice index = prompt index * n + sample index), streamed as SSE or returned whole."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from halserve.entrypoints.openai import serving_beam_search
from halserve.entrypoints.openai.constraints import constraint_messages
from halserve.entrypoints.openai.errors import BadRequestError
from halserve.entrypoints.openai.logprobs import (
    completion_logprobs,
    prompt_logprobs,
    prompt_text_offsets,
    token_decoder,
)
from halserve.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
    random_id,
)
from halserve.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ClientDisconnected,
    OpenAIServing,
    error_event,
    sendable_end,
    sse_event,
)

if TYPE_CHECKING:  # pragma: no cover
    from halserve.engine.async_llm import RequestStream
    from halserve.outputs import CompletionOutput, RequestOutput
    from halserve.sampling_params import SamplingParams


def normalize_prompts(prompt: Any, field: str = "prompt") -> list[str | list[int]]:
    """The request's ``prompt`` (or embeddings' ``input``) as a list of prompts (each a string
    or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequestError(f"{field} must not be empty", param=field)
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def prompt_only(output: CompletionOutput) -> CompletionOutput:
    """A finished choice as echo with max_tokens 0 returns it: without the token generated."""
    return dataclasses.replace(output, text="", token_ids=[], logprobs=[] if output.logprobs is not None else None,
                               text_offsets=[], cumulative_logprob=None, finish_reason="length", stop_reason=None)


class OpenAIServingCompletion:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, req: CompletionRequest, raw_request: Request) -> Response:
        serving = self.serving
        model = serving.check_model(req.model)
        if req.use_beam_search:  # vLLM's extra: each prompt's n best beams as its choices
            return await serving_beam_search.create_completion(self, req, raw_request, model)
        prompts = normalize_prompts(req.prompt)
        message_params = constraint_messages(req)
        params = serving.sampling_params(req.sampling_kwargs(), message_params)
        request_id = random_id("cmpl")
        try:
            streams = await serving.add_requests(prompts, params, request_id, lora_request=serving.lora_request(model),
                                                 message_params=message_params, raw_request=raw_request,
                                                 priority=req.priority)
        except ClientDisconnected:
            return Response(status_code=499)
        created = int(time.time())
        if req.stream:
            return StreamingResponse(
                self.stream_reply(req, params, streams, request_id, model, created),
                media_type="text/event-stream",
            )
        try:
            finals = await serving.collect(streams, raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(self._response(req, params, finals, request_id, model, created).model_dump())

    def _echoed(self, req: CompletionRequest, params: SamplingParams, out: RequestOutput
                ) -> tuple[RequestOutput | None, list[int] | None]:
        """The echoed prompt and its tokens' text offsets, for logprobs (None, None: no echo)."""
        if not req.echo or req.logprobs is None:
            return None, None
        return out, prompt_text_offsets(self.serving.tokenizer, out, params)

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.serving.tokenizer.decode(out.prompt_token_ids)

    def _response(
        self,
        req: CompletionRequest,
        params: SamplingParams,
        finals: list[RequestOutput],
        request_id: str,
        model: str,
        created: int,
    ) -> CompletionResponse:
        decode = token_decoder(req, self.serving.decode_token)
        choices = []
        prompt_tokens = completion_tokens = 0
        n = len(finals[0].outputs)
        for i, final in enumerate(finals):
            prompt_tokens += len(final.prompt_token_ids)
            prefix = self._prompt_text(final) if req.echo else ""
            scored_prompt = prompt_logprobs(final, decode) if req.prompt_logprobs is not None else None
            echoed = self._echoed(req, params, final)
            for o in final.outputs:
                o = prompt_only(o) if req.echo_only else o
                completion_tokens += len(o.token_ids)
                choices.append(
                    CompletionResponseChoice(
                        index=i * n + o.index,
                        text=prefix + o.text,
                        logprobs=completion_logprobs(o, 0, decode, len(prefix), *echoed),
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                        prompt_logprobs=scored_prompt,
                    )
                )
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
                prompt_tokens_details=self.serving.prompt_tokens_details(finals),
            ),
        )

    async def stream_reply(
        self,
        req: CompletionRequest,
        params: SamplingParams,
        streams: list[RequestStream],
        request_id: str,
        model: str,
        created: int,
    ) -> AsyncIterator[str]:
        decode = token_decoder(req, self.serving.decode_token)
        n, holdback = params.n, params.output_text_buffer_length
        sent_text: dict[int, int] = {}  # choice index -> characters of text sent
        sent_tokens: dict[int, int] = {}  # choice index -> tokens whose logprobs were sent
        bases: dict[int, int] = {}  # choice index -> where its own text starts (after an echoed prompt)
        finished: set[int] = set()
        prompt_tokens: dict[int, int] = {}
        completion_tokens: dict[int, int] = {}
        try:
            async for i, out in self.serving.merge(streams):
                prompt_tokens[i] = len(out.prompt_token_ids)
                choices = []
                for o in out.outputs:
                    index = i * n + o.index
                    if index in finished or (req.echo_only and o.finish_reason is None):
                        continue
                    o = prompt_only(o) if req.echo_only else o
                    completion_tokens[index] = len(o.token_ids)
                    first = index not in sent_text
                    prefix = self._prompt_text(out) if (req.echo and first) else ""
                    start_text = sent_text.get(index, 0)
                    start_tok = sent_tokens.get(index, 0)
                    end = sendable_end(o.text, start_text, o.finish_reason is not None, holdback)
                    delta = o.text[start_text:end]
                    new_logprobs = len(o.token_ids) > start_tok and req.logprobs is not None
                    if not (delta or prefix or o.finish_reason is not None or new_logprobs):
                        continue
                    if first:
                        bases[index] = len(prefix)
                    echoed = self._echoed(req, params, out) if prefix else (None, None)
                    logprobs = completion_logprobs(o, start_tok, decode, bases[index], *echoed)
                    sent_text[index] = end
                    sent_tokens[index] = len(o.token_ids)
                    if o.finish_reason is not None:
                        finished.add(index)
                    choices.append(
                        CompletionResponseChoice(
                            index=index,
                            text=prefix + delta,
                            logprobs=logprobs,
                            finish_reason=o.finish_reason,
                            stop_reason=o.stop_reason,
                        )
                    )
                if choices:
                    chunk = CompletionStreamResponse(id=request_id, created=created, model=model, choices=choices)
                    yield sse_event(chunk)
            if req.include_usage:
                p, c = sum(prompt_tokens.values()), sum(completion_tokens.values())
                usage = UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)
                yield sse_event(
                    CompletionStreamResponse(id=request_id, created=created, model=model, choices=[], usage=usage)
                )
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            yield error_event(exc)
        finally:
            for stream in streams:
                stream.close()
        yield SSE_DONE
