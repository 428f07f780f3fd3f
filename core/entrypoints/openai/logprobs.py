"""Engine logprobs (one ``{token_id: Logprob}`` dict per generated token) in the two
OpenAI formats: legacy completions (tokens / token_logprobs / top_logprobs /
text_offset) and chat (``content: [{token, logprob, bytes, top_logprobs}]``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from halserve.entrypoints.openai.chat_protocol import ChatChoiceLogprobs, ChatTokenLogprob, ChatTopLogprob
from halserve.entrypoints.openai.protocol import CompletionLogProbs, PromptLogprob, PromptLogprobs

if TYPE_CHECKING:  # pragma: no cover
    from halserve.outputs import CompletionOutput, RequestOutput
    from halserve.sampling_params import SamplingParams

Decode = Callable[[int], str]
_REPLACEMENT_CHAR = "\ufffd"  # what an incomplete UTF-8 character decodes to


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


class TextOffsets:
    """Legacy ``text_offset``: where each token's text starts in the choice's text.

    Offsets come from decoding the tokens the way the engine's detokenizer does (a
    sliding window with a few tokens of left context, ``skip_special_tokens`` honoured,
    see ``halserve.detokenizer``), so they index the text the engine produced rather
    than summing token strings. A token that adds no text takes zero width: a BOS that
    is not echoed, a skipped special token, the leading bytes of a character split over
    tokens; offsets never pass the text's end (a matched stop string cuts it, a stop
    token's own text is left out). One per choice, fed in order (a stream feeds each
    chunk's new tokens); ``base`` is where its text starts in the choice's text: after
    the echoed prompt.
    """

    def __init__(
        self,
        tokenizer: Any,
        params: "SamplingParams",
        context_ids: list[int],
        base: int = 0,
        skip_special_tokens: bool | None = None,
    ) -> None:
        from halserve.detokenizer import INITIAL_CONTEXT_TOKENS

        self._tokenizer = tokenizer
        self._params = params
        # decoded as the detokenizer does: a fast tokenizer's Rust decoder, else decode()
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._skip_special = params.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
        self._decode_kwargs: dict[str, Any] = {
            "skip_special_tokens": self._skip_special,
            "clean_up_tokenization_spaces": False,
        }
        if not params.spaces_between_special_tokens:
            self._decode_kwargs["spaces_between_special_tokens"] = False
        self.base = base
        # as the detokenizer: decode(ids[prefix:read]) is text already counted in length
        self._ids = list(context_ids[-INITIAL_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text: str | None = None  # decoded on first use (most requests ask no logprobs)
        self._window_text = ""  # decode(ids[prefix:])
        self._length = 0  # characters of text the tokens so far completed

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self._skip_special)
        return self._tokenizer.decode(ids, **self._decode_kwargs)

    def extend(self, token_ids: list[int], text_length: int) -> list[int]:
        """Offsets of the next ``token_ids``, none past ``text_length`` (the length of the
        text the tokens so far turned into)."""
        if self._prefix_text is None:
            self._prefix_text = self._window_text = self._decode(self._ids)
        offsets = []
        for token_id in token_ids:
            before = self._window_text
            self._ids.append(token_id)
            new_text = self._window_text = self._decode(self._ids[self._prefix :])
            complete = len(new_text) > len(self._prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR)
            start = self._length
            if complete and len(before) > len(self._prefix_text) and new_text.startswith(before):
                # text held back before this token (a stray byte's U+FFFD) comes first
                start += len(before) - len(self._prefix_text)
            offsets.append(self.base + min(start, text_length))
            if complete:
                self._length += len(new_text) - len(self._prefix_text)
                self._prefix, self._read = self._read, len(self._ids)
                self._prefix_text = self._window_text = self._decode(self._ids[self._prefix :])
        return offsets

    def prompt(self, request: "RequestOutput") -> list[int]:
        """Offsets of the echoed prompt's tokens in the text before ``base``. That text is
        the prompt string, which holds no special token the tokenizer added (a BOS), or
        for a prompt given as token ids ``tokenizer.decode(ids)``, which keeps them."""
        offsets = TextOffsets(self._tokenizer, self._params, [], skip_special_tokens=request.prompt is not None)
        return offsets.extend(request.prompt_token_ids, self.base)


def completion_logprobs(
    output: "CompletionOutput",
    start: int,
    decode: Decode,
    offsets: TextOffsets,
    echoed: "RequestOutput | None" = None,
) -> CompletionLogProbs | None:
    """Logprobs of ``output.token_ids[start:]``, ``offsets`` having seen the tokens before
    them. ``echoed``: the request whose prompt is echoed in front of them (echo with
    logprobs), scored by its ``prompt_logprobs``."""
    if output.logprobs is None:
        return None
    result = CompletionLogProbs()
    if echoed is not None and echoed.prompt_logprobs is not None:
        _append_legacy(result, echoed.prompt_token_ids, echoed.prompt_logprobs, decode, offsets.prompt(echoed))
    token_ids = output.token_ids[start:]
    _append_legacy(result, token_ids, output.logprobs[start:], decode, offsets.extend(token_ids, len(output.text)))
    return result


def prompt_logprobs(output: "RequestOutput", decode: Decode) -> PromptLogprobs | None:
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
