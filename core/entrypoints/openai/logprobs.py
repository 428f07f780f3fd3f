"""Engine logprobs (one ``{token_id: Logprob}`` dict per generated token) in the two
OpenAI formats: legacy completions (tokens / token_logprobs / top_logprobs /
text_offset) and chat (``content: [{token, logprob, bytes, top_logprobs}]``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from halserve.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogProbs,
)

if TYPE_CHECKING:  # pragma: no cover
    from halserve.outputs import CompletionOutput

Decode = Callable[[int], str]


def _token_text(token_id: int, entry: Any, decode: Decode) -> str:
    text = getattr(entry, "decoded_token", None)
    return text if text is not None else decode(token_id)


def _finite(value: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number.
    return value if value > -9999.0 else -9999.0


def completion_logprobs(
    output: "CompletionOutput", start: int, decode: Decode, text_offset: int
) -> CompletionLogProbs | None:
    """Logprobs of ``output.token_ids[start:]``; ``text_offset`` is where the first of
    them begins in the text the client has received."""
    if output.logprobs is None:
        return None
    result = CompletionLogProbs()
    offset = text_offset
    for token_id, entry in zip(output.token_ids[start:], output.logprobs[start:]):
        sampled = entry.get(token_id)
        token = _token_text(token_id, sampled, decode)
        result.tokens.append(token)
        result.token_logprobs.append(_finite(sampled.logprob) if sampled is not None else None)
        result.top_logprobs.append({_token_text(t, lp, decode): _finite(lp.logprob) for t, lp in entry.items()})
        result.text_offset.append(offset)
        offset += len(token)
    return result


def chat_logprobs(output: "CompletionOutput", start: int, top_n: int, decode: Decode) -> ChatChoiceLogprobs | None:
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
