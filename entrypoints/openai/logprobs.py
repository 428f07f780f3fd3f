"""Engine logprobs (one ``{token_id: Logprob}`` dict per generated token) in the two
OpenAI formats: legacy completions (tokens / token_logprobs / top_logprobs /
text_offset) and chat (``content: [{token, logprob, bytes, top_logprobs}]``)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from halserve.entrypoints.openai.chat_protocol import ChatChoiceLogprobs, ChatTokenLogprob, ChatTopLogprob
from halserve.entrypoints.openai.protocol import CompletionLogProbs, PromptLogprob, PromptLogprobs

if TYPE_CHECKING:  # pragma: no cover
    from halserve.outputs import CompletionOutput, RequestOutput
    from halserve.sampling_params import SamplingParams

Decode = Callable[[int], str]


def token_id_text(token_id: int) -> str:
    """vLLM's ``return_tokens_as_token_ids``: tokens as "token_id:{id}" instead of their text
    (a token that is not valid UTF-8 on its own stays identifiable)."""
    return f"token_id:{token_id}"


def token_decoder(request: Any, decode: Decode) -> Decode:
    """How a request's logprobs name tokens: ``decode`` (their text), or ``token_id_text``
    when it set ``return_tokens_as_token_ids``."""
    return token_id_text if request.return_tokens_as_token_ids else decode


def _token_text(token_id: int, entry: Any, decode: Decode) -> str:
    text = getattr(entry, "decoded_token", None)
    return text if text is not None and decode is not token_id_text else decode(token_id)


def _finite(value: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number.
    return value if value > -9999.0 else -9999.0


def _append_legacy(result: CompletionLogProbs, token_ids: Any, entries: Any, decode: Decode, offsets: Any) -> None:
    """Append one row per token to ``result``; an entry of None (the prompt's first token,
    which nothing scores) gives nulls, as OpenAI's echo does."""
    for token_id, entry, offset in zip(token_ids, entries, offsets):
        sampled = entry.get(token_id) if entry is not None else None
        result.tokens.append(_token_text(token_id, sampled, decode))
        result.token_logprobs.append(_finite(sampled.logprob) if sampled is not None else None)
        result.top_logprobs.append(
            None if entry is None else {_token_text(t, lp, decode): _finite(lp.logprob) for t, lp in entry.items()}
        )
        result.text_offset.append(offset)


def prompt_text_offsets(tokenizer: Any, request: RequestOutput, params: SamplingParams) -> list[int]:
    """``text_offset`` of an echoed prompt's tokens: decoded as the engine's detokenizer
    decodes output. The echoed text is the prompt string, which holds no special token the
    tokenizer added (a BOS: zero width), or for a prompt given as token ids
    ``tokenizer.decode(ids)``, which keeps them."""
    from halserve.detokenizer import IncrementalDetokenizer
    from halserve.sampling_params import SamplingParams

    decode_params = SamplingParams(skip_special_tokens=request.prompt is not None, logprobs=0,
                                   spaces_between_special_tokens=params.spaces_between_special_tokens)
    detokenizer = IncrementalDetokenizer(tokenizer, [], decode_params)
    detokenizer.update(list(request.prompt_token_ids))
    return detokenizer.token_offsets or []


def completion_logprobs(
    output: CompletionOutput,
    start: int,
    decode: Decode,
    base: int = 0,
    echoed: RequestOutput | None = None,
    echoed_offsets: list[int] | None = None,
) -> CompletionLogProbs | None:
    """Logprobs of ``output.token_ids[start:]``; their text offsets are the engine's
    (``CompletionOutput.text_offsets``) moved by ``base``, where the choice's own text starts
    (after an echoed prompt). ``echoed``: the request whose prompt is echoed in front of them
    (echo with logprobs), scored by its ``prompt_logprobs``, at ``echoed_offsets``."""
    if output.logprobs is None:
        return None
    result = CompletionLogProbs()
    if echoed is not None and echoed.prompt_logprobs is not None:
        offsets = [min(o, base) for o in echoed_offsets or [0] * len(echoed.prompt_token_ids)]
        _append_legacy(result, echoed.prompt_token_ids, echoed.prompt_logprobs, decode, offsets)
    token_ids = output.token_ids[start:]
    own = output.text_offsets[start:] if output.text_offsets is not None else [0] * len(token_ids)
    _append_legacy(result, token_ids, output.logprobs[start:], decode, [base + o for o in own])
    return result


def prompt_logprobs(output: RequestOutput, decode: Decode) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` response field, from the engine's (None when not asked)."""
    if output.prompt_logprobs is None:
        return None
    return [
        None if entry is None else {
            tid: PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=_token_text(tid, lp, decode))
            for tid, lp in entry.items()
        }
        for entry in output.prompt_logprobs
    ]


def chat_logprobs(output: CompletionOutput, start: int, top_n: int, decode: Decode) -> ChatChoiceLogprobs | None:
    """Chat-format logprobs of ``output.token_ids[start:]`` with ``top_n`` alternatives."""
    if output.logprobs is None:
        return None
    content: list[ChatTokenLogprob] = []
    for token_id, entry in zip(output.token_ids[start:], output.logprobs[start:]):
        sampled = entry.get(token_id)
        token = _token_text(token_id, sampled, decode)
        ranked = sorted(entry.items(), key=lambda item: -item[1].logprob)[:top_n]
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=_finite(sampled.logprob) if sampled is not None else -9999.0,
                bytes=list(token.encode("utf-8")),
                top_logprobs=[
                    ChatTopLogprob(
                        token=(text := _token_text(t, lp, decode)),
                        logprob=_finite(lp.logprob),
                        bytes=list(text.encode("utf-8")),
                    )
                    for t, lp in ranked
                ],
            )
        )
    return ChatChoiceLogprobs(content=content)
