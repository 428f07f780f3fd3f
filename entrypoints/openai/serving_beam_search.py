"""``use_beam_search: true`` (vLLM's extra) on /v1/completions and /v1/chat/completions: the
request runs ``AsyncLLM.beam_search`` instead of sampling and each prompt's ``n`` best beams
(``n`` is the beam width) are its choices, best first; a chat reply is read as the endpoint
reads any (its ``reply_message``: a reasoning parser splits off the thinking). The search runs to its
end before anything is sent: a chat ``stream`` then gets the result through the endpoint's
stream code, one delta per choice (as vLLM's); a completions ``stream`` is a 400 (as vLLM's).
A client that goes away mid-search aborts the step's requests.

Beam search ranks beams by the model's own logprobs, so what would change them (sampling
options, logit biases, stop conditions, constraints, tools) or ask for more than it returns
(logprobs) is a 400 naming the field; ``max_tokens``, ``ignore_eos``,
``include_stop_str_in_output``, ``length_penalty`` and the decoding options apply.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from halserve.beam_search import MAX_BEAM_WIDTH, BeamSearchOutput, BeamSearchParams
from halserve.engine.async_llm import EngineDeadError
from halserve.entrypoints.openai.chat_protocol import ChatCompletionResponse, ChatCompletionResponseChoice
from halserve.entrypoints.openai.errors import BadRequestError, OpenAIError
from halserve.entrypoints.openai.protocol import CompletionResponse, CompletionResponseChoice, UsageInfo, random_id
from halserve.entrypoints.openai.serving_engine import ClientDisconnected, OpenAIServing, wait_disconnect

if TYPE_CHECKING:  # pragma: no cover
    from halserve.entrypoints.openai.chat_protocol import ChatCompletionRequest
    from halserve.entrypoints.openai.protocol import CompletionRequest, SamplingRequest
    from halserve.entrypoints.openai.serving_chat import OpenAIServingChat
    from halserve.entrypoints.openai.serving_completions import OpenAIServingCompletion
    from halserve.outputs import RequestOutput
    from halserve.sampling_params import SamplingParams

__all__ = ["create_chat_completion", "create_completion"]

# Fields beam search cannot honour -> the values that leave them off (None, unset, always does).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "top_p": (1, 1.0),
    "top_k": (0, -1),
    "min_p": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "min_tokens": (0,),
    "stop": ([],),
    "stop_token_ids": ([],),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "logit_bias": ({},),
    "truncate_prompt_tokens": (),
    "prompt_logprobs": (),
    "logprobs": (),  # (completions: an int, 0 too; chat: a bool, false is off)
    "top_logprobs": (),
    "tools": ([],),
    "structured_outputs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
}


def beam_search_params(req: SamplingRequest, max_tokens: int | None, max_model_len: int | None) -> BeamSearchParams:
    """The request's ``BeamSearchParams``; a 400 naming the field it cannot honour.
    ``max_tokens`` None: up to the context's end."""
    for name, off in _UNSUPPORTED.items():
        value = getattr(req, name, None)
        if value is not None and value is not False and value not in off:
            raise BadRequestError(f"{name}={value!r:.80} cannot be used with use_beam_search (beam search keeps the "
                                  f"beams the model's own logprobs rank best and returns no per-token logprobs); "
                                  f"leave {name} out", param=name)
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        raise BadRequestError("response_format cannot be used with use_beam_search: beam search does not constrain "
                              "its output; leave response_format out", param="response_format")
    if req.temperature not in (None, 0):
        raise BadRequestError(f"temperature must be 0 (or left out) with use_beam_search, got {req.temperature}: "
                              "beam search ranks beams by the model's own logprobs, nothing is sampled",
                              param="temperature")
    n = req.n or 1
    if n > MAX_BEAM_WIDTH:
        raise BadRequestError(f"n is the beam width with use_beam_search and must be at most {MAX_BEAM_WIDTH}, got "
                              f"{n} (each step asks for the 2 * n most likely next tokens of every beam)", param="n")
    try:
        return BeamSearchParams(
            beam_width=n,
            max_tokens=max_tokens if max_tokens is not None else (max_model_len or 1),
            ignore_eos=bool(req.ignore_eos),
            length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
        )
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]  # (its messages start with the field's name)
        raise BadRequestError(str(exc), param=field) from None


def decoding_params(req: SamplingRequest) -> SamplingParams:
    """How the beams' tokens become text: the request's decoding options."""
    from halserve.sampling_params import SamplingParams

    keys = ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output")
    return SamplingParams(**{key: getattr(req, key) for key in keys if getattr(req, key) is not None})


def request_output(out: BeamSearchOutput, request_id: str, prompt_text: str | None, tokenizer: Any,
                   params: SamplingParams) -> RequestOutput:
    """A search's result as a finished ``RequestOutput`` whose outputs are the beams, best first:
    their generated tokens, decoded as the engine decodes a completion."""
    from halserve.detokenizer import IncrementalDetokenizer
    from halserve.outputs import CompletionOutput, RequestOutput

    prompt_ids = out.prompt_token_ids
    outputs = []
    for index, seq in enumerate(out.sequences):
        token_ids = seq.tokens[len(prompt_ids):]
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params)
        detokenizer.update(token_ids)
        outputs.append(CompletionOutput(index=index, text=detokenizer.output_text, token_ids=token_ids,
                                        cumulative_logprob=seq.cum_logprob, logprobs=None,
                                        finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
    return RequestOutput(request_id=request_id, prompt=prompt_text, prompt_token_ids=prompt_ids, outputs=outputs,
                         finished=True)


async def search(serving: OpenAIServing, prompts: list[Any], params: BeamSearchParams, request_id: str,
                 raw_request: Request, prompt_param: str, model: str) -> list[BeamSearchOutput]:
    """Run the searches (with the LoRA adapter ``model`` names, if it names one) until done, or
    until the client goes away (``ClientDisconnected``: cancelled, their requests aborted). A
    prompt the engine refuses is a 400 on ``prompt_param``; a dead engine a 503."""
    searching = serving.engine.beam_search(prompts, params, request_id, lora_request=serving.lora_request(model))
    try:
        return await _until_disconnect(searching, raw_request)
    except ValueError as exc:
        raise BadRequestError(str(exc), param="model" if str(exc).startswith("LoRA adapter") else prompt_param) from None
    except EngineDeadError as exc:
        raise OpenAIError(str(exc), status_code=503, code="engine_dead") from None


async def _until_disconnect(work: Awaitable[Any], raw_request: Request) -> Any:
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(raw_request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientDisconnected()
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with suppress(BaseException):
                await task


class _Finished:
    """A finished request's output as a one-item stream, what the endpoints' stream code reads."""

    def __init__(self, output: RequestOutput) -> None:
        self._output: RequestOutput | None = output

    def __aiter__(self) -> _Finished:
        return self

    async def __anext__(self) -> RequestOutput:
        output, self._output = self._output, None
        if output is None:
            raise StopAsyncIteration
        return output

    def close(self) -> None:
        self._output = None


# ---------------------------------------------------------------------- endpoints
async def create_completion(handler: OpenAIServingCompletion, req: CompletionRequest, raw_request: Request,
                            model: str) -> Response:
    """/v1/completions with use_beam_search: each prompt's n best beams, choice index = prompt
    index * n + rank (a search may return fewer: a vocabulary under 2 * n tokens)."""
    from halserve.entrypoints.openai.serving_completions import normalize_prompts

    serving = handler.serving
    if req.stream:
        raise BadRequestError("stream is not supported with use_beam_search on /v1/completions (as in vLLM): the "
                              "search ends before any text is final; set stream to false", param="stream")
    params = beam_search_params(req, req.max_tokens, serving.max_model_len)
    prompts = normalize_prompts(req.prompt)
    request_id = random_id("cmpl")
    created = int(time.time())
    try:
        outs = await search(serving, prompts, params, request_id, raw_request, "prompt", model)
    except ClientDisconnected:
        return Response(status_code=499)
    decoding = decoding_params(req)
    choices = []
    prompt_tokens = completion_tokens = 0
    for i, (out, prompt) in enumerate(zip(outs, prompts)):
        final = request_output(out, request_id, prompt if isinstance(prompt, str) else None, serving.tokenizer,
                               decoding)
        prompt_tokens += len(final.prompt_token_ids)
        prefix = "" if not req.echo else final.prompt or serving.tokenizer.decode(final.prompt_token_ids)
        for o in final.outputs:
            completion_tokens += len(o.token_ids)
            choices.append(CompletionResponseChoice(index=i * params.beam_width + o.index, text=prefix + o.text,
                                                    finish_reason=o.finish_reason, stop_reason=o.stop_reason))
    usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens)
    response = CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage)
    return JSONResponse(response.model_dump())


async def create_chat_completion(handler: OpenAIServingChat, req: ChatCompletionRequest, raw_request: Request,
                                 model: str) -> Response:
    """/v1/chat/completions with use_beam_search: the n best beams as the choices, each reply
    read as the endpoint reads any (a reasoning parser splits off the thinking)."""
    serving = handler.serving
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = beam_search_params(req, max_tokens, serving.max_model_len)
    prompt_text, prompt_ids = await handler.render(req)
    start = serving.reasoning_parser.reply_start(prompt_text) if serving.reasoning_parser else None
    request_id = random_id("chatcmpl")
    created = int(time.time())
    try:
        (out,) = await search(serving, [prompt_ids], params, request_id, raw_request, "messages", model)
    except ClientDisconnected:
        return Response(status_code=499)
    final = request_output(out, request_id, prompt_text, serving.tokenizer, decoding_params(req))
    if req.stream:
        return StreamingResponse(handler.stream_reply(req, _Finished(final), request_id, model, created, 0, 0, start),
                                 media_type="text/event-stream")
    response = _chat_response(handler.reply_message, req, final, start, request_id, model, created)
    return JSONResponse(response.model_dump())


def _chat_response(reply: Callable[..., Any], req: ChatCompletionRequest, final: RequestOutput, start: Any,
                   request_id: str, model: str, created: int) -> ChatCompletionResponse:
    choices = []
    for o in final.outputs:
        message, finish_reason = reply(req, o, start)
        choices.append(ChatCompletionResponseChoice(index=o.index, message=message, finish_reason=finish_reason,
                                                    stop_reason=o.stop_reason))
    prompt_tokens = len(final.prompt_token_ids)
    completion_tokens = sum(len(o.token_ids) for o in final.outputs)
    usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens)
    return ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage)
