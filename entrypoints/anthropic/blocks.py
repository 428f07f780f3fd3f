"""A reply's content blocks in Anthropic's shapes: ``content_blocks`` for a whole reply, and
``BlockWriter`` for one streamed as it is generated. The two agree: a reply streamed in any
pieces gives the blocks ``content_blocks`` gives for it whole (but for a call the model
breaks after its arguments began to stream: see ``tool_parsers.base``).

The text around tool calls: a text block right before or after a call loses the whitespace
next to the call, and with calls in the reply every text block its trailing whitespace (the
tool parser holds whitespace back while the next thing may be a call); whitespace alone is no
block. A reply without calls is its text as generated.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from halserve.entrypoints.anthropic.protocol import anthropic_id
from halserve.entrypoints.openai.tool_parsers import ToolCallDelta

__all__ = ["BlockWriter", "ReplyItem", "content_blocks", "sse"]

# A reply's text or one of its calls, ``(name, arguments JSON)``, in the order the model wrote them.
ReplyItem = str | tuple[str, str]

TEXT_BLOCK = {"type": "text", "text": ""}
THINKING_BLOCK = {"type": "thinking", "thinking": "", "signature": ""}


def sse(kind: str, payload: dict[str, Any]) -> str:
    """One Anthropic SSE event: its type as the event name and in the data."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


def tool_use_block(name: str, arguments: str) -> dict[str, Any] | None:
    """A tool_use block for a call, or ``None`` if its arguments are no JSON object (a named call
    cut short by max_tokens): such a call stays text, as the model wrote it."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return {"type": "tool_use", "id": anthropic_id("toolu"), "name": name, "input": value}


def content_blocks(items: list[ReplyItem]) -> list[dict[str, Any]]:
    """The text and tool_use blocks of a whole reply's ``items``."""
    pieces: list[str | dict[str, Any]] = []
    for item in items:
        if isinstance(item, str):
            pieces.append(item)
            continue
        block = tool_use_block(*item)
        pieces.append(item[1] if block is None else block)
    has_calls = any(not isinstance(piece, str) for piece in pieces)
    blocks: list[dict[str, Any]] = []
    run: list[str] = []

    def flush() -> None:
        text = "".join(run)
        run.clear()
        if blocks and blocks[-1]["type"] == "tool_use":
            text = text.lstrip()
        if has_calls:
            text = text.rstrip()
        if text:
            blocks.append({"type": "text", "text": text})

    for piece in pieces:
        if isinstance(piece, str):
            run.append(piece)
        else:
            flush()
            blocks.append(piece)
    flush()
    return blocks


class BlockWriter:
    """The content blocks of one streamed message as SSE events: a block opens
    (``content_block_start``), takes deltas and closes (``content_block_stop``) when the next one
    opens or at ``finish``; a ``ping`` follows the first block's start (or, with no block, comes
    at ``finish``)."""

    def __init__(self) -> None:
        self.index = -1  # the last opened block's
        self.open_type: str | None = None  # the open block's type (None: none is open)
        self.last_type: str | None = None  # the last opened block's type, open or not
        self.has_pinged = False
        self.num_calls = 0  # tool_use blocks opened
        # whitespace at the end of the text so far, sent once more text follows (dropped if a
        # call does: as content_blocks, the text before a call loses it)
        self.pending_space = ""

    def open(self, content_block: dict[str, Any]) -> Iterator[str]:
        yield from self.close()
        self.pending_space = ""
        self.index += 1
        self.open_type = self.last_type = content_block["type"]
        yield sse("content_block_start", {"index": self.index, "content_block": content_block})
        if not self.has_pinged:
            self.has_pinged = True
            yield sse("ping", {})

    def close(self) -> Iterator[str]:
        if self.open_type is not None:
            yield sse("content_block_stop", {"index": self.index})
            self.open_type = None

    def finish(self) -> Iterator[str]:
        """Close the last block; the ping if no block came."""
        if self.pending_space and not self.num_calls:
            yield from self._delta("text_delta", {"text": self.pending_space}, TEXT_BLOCK)
        yield from self.close()
        if not self.has_pinged:
            self.has_pinged = True
            yield sse("ping", {})

    def _delta(self, kind: str, body: dict[str, Any], content_block: dict[str, Any]) -> Iterator[str]:
        if self.open_type != content_block["type"]:
            yield from self.open(content_block)
        yield sse("content_block_delta", {"index": self.index, "delta": {"type": kind, **body}})

    def thinking(self, text: str) -> Iterator[str]:
        if text:
            yield from self._delta("thinking_delta", {"thinking": text}, THINKING_BLOCK)

    def text(self, text: str) -> Iterator[str]:
        if self.open_type != "text" and self.last_type == "tool_use":
            text = text.lstrip()  # (text after a call: as content_blocks)
        text = self.pending_space + text
        sendable = text.rstrip()
        if sendable:
            yield from self._delta("text_delta", {"text": sendable}, TEXT_BLOCK)
        self.pending_space = text[len(sendable) :]

    def call(self, piece: ToolCallDelta) -> Iterator[str]:
        """A streamed call's delta: its first opens its tool_use block (id, name, input {}),
        its arguments follow as ``input_json_delta`` fragments."""
        if piece.name is not None:
            assert piece.index == self.num_calls, "a tool parser starts calls in order"
            yield from self.open({"type": "tool_use", "id": anthropic_id("toolu"), "name": piece.name, "input": {}})
            self.num_calls += 1
        if piece.arguments:
            # (a parser adds to a call's arguments only until the next thing in the reply begins)
            assert self.open_type == "tool_use" and piece.index == self.num_calls - 1
            yield sse("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": piece.arguments}})

    def whole(self, content_block: dict[str, Any]) -> Iterator[str]:
        """A text or tool_use block known whole (a forced call's, at the end of the reply)."""
        if content_block["type"] == "text":
            yield from self.text(content_block["text"])
            return
        yield from self.open({**content_block, "input": {}})
        self.num_calls += 1
        yield sse("content_block_delta", {"index": self.index, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(content_block["input"], ensure_ascii=False)}})
