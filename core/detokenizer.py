"""Incremental detokenization of one completion, with stop strings (vLLM semantics).

Text is decoded through a small sliding window of token ids instead of re-decoding the
whole output each step (vLLM's ``detokenize_incrementally``):

    ids:  ... p p p p p | o o o o | n
                        ^prefix   ^read
    prefix_text = decode(ids[prefix:read])      text already emitted for the window
    new_text    = decode(ids[prefix:])          same window plus the unread tokens
    delta       = new_text[len(prefix_text):]

Decoding the window with a few tokens of left context keeps word-boundary spaces right
for SentencePiece/BPE tokenizers (a lone "▁world" decodes to "world", in context to
" world"). A window whose text ends in U+FFFD holds an incomplete UTF-8 character (an
emoji split over byte tokens): nothing is emitted until a later token completes it.
"""
from __future__ import annotations

from typing import Any

from halserve.sampling_params import SamplingParams

# Prompt tokens kept as left context for the first output tokens (as vLLM).
INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Owned by the engine's output processor, one per completion; ``update`` is called
    with each step's new token ids."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.output_text = ""  # text so far (cut at a matched stop string)
        self.output_token_ids: list[int] = []
        self.stop_string: str | None = None  # the stop string that ended the text, once matched
        # where each output token's text starts in output_text (logprobs' text_offset): a token
        # that adds no text (a skipped special token, part of a split character) takes zero width
        self.token_offsets: list[int] | None = [] if params.logprobs is not None else None
        self._skip_special = params.skip_special_tokens
        # Fast tokenizers: decode through the Rust tokenizer directly (their decode() is
        # that plus an optional cleanup we never apply, and they ignore
        # spaces_between_special_tokens); anything else goes through decode().
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode_kwargs: dict[str, Any] = {
            "skip_special_tokens": params.skip_special_tokens,
            "clean_up_tokenization_spaces": False,
        }
        if not params.spaces_between_special_tokens:  # only slow tokenizers read it
            self._decode_kwargs["spaces_between_special_tokens"] = False

        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._ids = context  # left context + all output ids
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = None  # decode(ids[prefix:read]), cached until offsets move
        self._pending_text: str | None = None  # decode(ids[prefix:]) while it emitted nothing yet
        self._stop_check_offset = 0  # stop strings must end at or after this character
        self._last_output_offset = 0  # characters already handed out by get_next_output_text

    # ------------------------------------------------------------------ decoding
    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self._skip_special)
        return self.tokenizer.decode(ids, **self._decode_kwargs)

    def _decode_next(self) -> tuple[str, int]:
        """Text completed by the tokens appended since the last emitted text ('' if none), and
        where in it the last token's own text starts (after text the tokens before it left
        pending, e.g. a stray byte's U+FFFD)."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        pending, self._pending_text = self._pending_text, new_text
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return "", 0  # a skipped special token, or an incomplete UTF-8 character: wait
        lead = 0
        if pending is not None and len(pending) > len(self._prefix_text) and new_text.startswith(pending):
            lead = len(pending) - len(self._prefix_text)
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._pending_text = None
        return delta, lead

    # ------------------------------------------------------------------ per step
    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append one step's token ids; return the stop string that now ends the text, or None.

        ``stop_terminated``: the last id is the EOS or a stop_token_id that ended the
        request; its text is left out unless include_stop_str_in_output (as vLLM).
        Stop strings are checked after each token: when one matches, the tokens after the
        one that completed it (a step can bring several: speculative decoding) are dropped,
        so ``output_token_ids`` ends with that token. Once a stop string matched, further
        calls change nothing.
        """
        if not new_token_ids or self.stop_string is not None:
            return None
        params = self.params
        if not params.detokenize:
            self.output_token_ids.extend(new_token_ids)
            return None
        skipped: int | None = None
        if stop_terminated and not params.include_stop_str_in_output:
            skipped = new_token_ids[-1]
            new_token_ids = new_token_ids[:-1]

        min_tokens = params.min_tokens
        offsets = self.token_offsets
        for token_id in new_token_ids:
            self._ids.append(token_id)
            self.output_token_ids.append(token_id)
            delta, lead = self._decode_next()
            if offsets is not None:
                offsets.append(len(self.output_text) + lead)
            self.output_text += delta
            # Stop strings completed within the first min_tokens tokens do not count.
            if len(self.output_token_ids) <= min_tokens:
                self._stop_check_offset = len(self.output_text)
            elif params.stop and (stop := self._check_stop_strings()) is not None:
                return stop
        if skipped is not None:  # (it adds no text: no stop string can end in it)
            self._ids.append(skipped)
            self.output_token_ids.append(skipped)
            if offsets is not None:
                offsets.append(len(self.output_text))
        return None

    def _check_stop_strings(self) -> str | None:
        """Find a stop string that ends in the text added since the last check; cut the
        text at it. When several match, the one completed first wins."""
        text = self.output_text
        start = self._stop_check_offset
        self._stop_check_offset = len(text)
        if start >= len(text):
            return None
        best: tuple[int, int, str] | None = None  # (end, begin, stop string)
        for stop in self.params.stop or ():  # (a list since SamplingParams.__post_init__)
            # only matches ending in the new text: earlier ones were checked before
            begin = text.find(stop, max(0, start - len(stop) + 1))
            if begin != -1 and (best is None or (begin + len(stop), begin) < best[:2]):
                best = (begin + len(stop), begin, stop)
        if best is None:
            return None
        end, begin, stop = best
        self.output_text = text[:end] if self.params.include_stop_str_in_output else text[:begin]
        self.stop_string = stop
        return stop

    # ------------------------------------------------------------------ streaming
    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to send now: all of it (``delta=False``) or what is new since the last call.

        Until the request finishes, the last (longest stop string - 1) characters are held
        back, so a stop string's prefix is never sent and then cut."""
        buffer = 0 if finished or self.stop_string is not None else self.params.output_text_buffer_length
        length = max(len(self.output_text) - buffer, 0)
        if not delta:
            return self.output_text[:length]
        last = self._last_output_offset
        if length <= last:
            return ""
        self._last_output_offset = length
        return self.output_text[last:length]

    def get_delta(self, finished: bool = False) -> str:
        """Streaming shorthand for ``get_next_output_text(finished, delta=True)``."""
        return self.get_next_output_text(finished, delta=True)
