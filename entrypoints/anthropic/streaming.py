"""One streamed Messages reply: the growing output of its request in, Anthropic's events out::

    message_start
    content_block_start (thinking) ping  content_block_delta (thinking_delta)*  content_block_stop
    content_block_start (text)           content_block_delta (text_delta)*      content_block_stop
    content_block_start (tool_use)       content_block_delta (input_json_delta)* content_block_stop  (per call)
    message_delta (stop_reason, stop_sequence, usage)
    message_stop

Thinking and text stream as they are generated. With tool_choice auto the tool parser finds
the calls as they are written: the text before a call streams, held back only while it may
be a call's start; a call's tool_use block opens once its name is known and its arguments
stream as ``input_json_delta`` fragments that concatenate to its input's JSON; text after a
call is a further text block. Forced calls (tool_choice any or tool) are known once the reply
is whole: they come at the end, each call's input in one delta.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from halserve.entrypoints.anthropic.blocks import BlockWriter, ReplyItem, content_blocks, sse
from halserve.entrypoints.openai.errors import OpenAIError
from halserve.entrypoints.openai.serving_engine import sendable_end

if TYPE_CHECKING:  # pragma: no cover
    from halserve.entrypoints.anthropic.protocol import StopReason
    from halserve.entrypoints.openai.chat_protocol import ChatCompletionRequest
    from halserve.entrypoints.openai.tool_parsers import ToolParser
    from halserve.outputs import CompletionOutput

__all__ = ["ABORTED", "MessageEvents", "stop_reason_of"]

ABORTED = "the request was aborted before it finished (the server is shutting down); send it again"


def stop_reason_of(output: CompletionOutput, finish: str | None, has_calls: bool) -> tuple[StopReason, str | None]:
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


class MessageEvents:
    """The events of one streamed reply. ``start`` once, then ``feed`` each new state of the
    output (its text only grows); the final state's events end with ``message_stop``.

    ``split``: the reply so far (its text, whether it is whole) as ``(reasoning, content)``.
    ``tool_parser``: a fresh parser for tool_choice auto (``None``: no tools, or forced calls).
    ``whole_reply``: a finished output's text and calls (forced calls are read once whole).
    ``holdback``: characters kept back while they may still become a stop string."""

    def __init__(self, chat_req: ChatCompletionRequest, split: Callable[[str, bool], tuple[str | None, str | None]],
                 tool_parser: ToolParser | None,
                 whole_reply: Callable[[CompletionOutput], list[ReplyItem]], holdback: int) -> None:
        self.chat_req = chat_req
        self.split = split
        self.tool_parser = tool_parser
        self.whole_reply = whole_reply
        self.holdback = holdback
        self.blocks = BlockWriter()
        self.sent_text = 0  # how much of the output's text was read
        self.sent_reasoning = 0  # ... and of its reasoning and content sent
        self.sent_content = 0

    @staticmethod
    def start(message_id: str, model: str, num_prompt_tokens: int) -> str:
        usage = {"input_tokens": num_prompt_tokens, "output_tokens": 0}
        return sse("message_start", {"message": {
            "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage}})

    def feed(self, output: CompletionOutput, num_prompt_tokens: int) -> Iterator[str]:
        req, blocks = self.chat_req, self.blocks
        final = output.finish_reason is not None
        self.sent_text = sendable_end(output.text, self.sent_text, final, self.holdback)
        text = output.text[: self.sent_text]
        # the reply so far (each split of the sendable text extends the previous one's parts)
        reasoning, content = self.split(text, final)
        thought = (reasoning or "")[self.sent_reasoning :]
        self.sent_reasoning += len(thought)
        if req.include_reasoning:
            yield from blocks.thinking(thought)
        if req.calls_tools:
            pass  # (forced calls: at the end)
        elif self.tool_parser is not None:
            for piece in self.tool_parser.stream_pieces(content, final) if content is not None else ():
                yield from blocks.text(piece) if isinstance(piece, str) else blocks.call(piece)
        else:
            new = (content or "")[self.sent_content :]
            self.sent_content += len(new)
            yield from blocks.text(new)
        if not final:
            return
        if req.calls_tools:
            for content_block in content_blocks(self.whole_reply(output)):
                yield from blocks.whole(content_block)
        yield from blocks.finish()
        stop_reason, stop_sequence = stop_reason_of(output, output.finish_reason, blocks.num_calls > 0)
        yield sse("message_delta", {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"input_tokens": num_prompt_tokens, "output_tokens": len(output.token_ids)},
        })
        yield sse("message_stop", {})
