"""The tool-call parser interface: one class per format a model writes its calls in.

A parser instance serves one reply (one choice). The serving layer builds it with the
request's tools and ``max_calls`` and then either

- ``parse(text)`` once, on the whole reply: ``(content or None, [(name, arguments JSON)])``; or
- ``stream(text, final)`` after each new piece of the reply (``text`` is the whole reply so far,
  it only grows): what to send now, as a ``ToolStreamDelta``: new content text, and per call a
  first delta with its ``id`` and ``name`` (``arguments`` may already start there) and then
  deltas adding to its ``arguments``. ``stream_pieces`` is the same delta as a list in the
  reply's order (content strings and call deltas), for APIs whose text and calls are
  ordered blocks (Anthropic's content); ``parse_items`` is ``parse``'s answer in that order.

The two agree: a reply streamed in any pieces yields the calls ``parse`` finds, and a call's
argument deltas concatenate to its ``arguments``. The exception is a call the model breaks (or
that ``max_tokens`` cuts) after its arguments began to stream: sent deltas cannot be taken back,
so the streamed call keeps what was sent, while ``parse`` leaves that call as text.

A format implements one method, ``scan(text, final)``: the reply so far as content strings and
``ScannedCall`` items, in order. Scans of a growing text must extend each other: content
joined only grows, a call keeps its place and its ``arguments`` only grow. Text that may still
turn out to be (part of) a call is left out until that is known (held back). A block is
reported as a call only once its name is known and accepted (``accepts``) and its arguments
began; before that, a block that cannot be a call is content.
"""
from __future__ import annotations

import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

# (content left for the message or None, [(function name, arguments as JSON text)])
ParsedCalls = tuple[str | None, list[tuple[str, str]]]


@dataclass(slots=True)
class ScannedCall:
    name: str
    arguments: str  # canonical JSON text so far (a prefix of the final arguments)
    is_complete: bool  # the call is written whole and valid
    raw: str  # the model's text of the call, as far as read (content if the call is not whole)


@dataclass(slots=True)
class ToolCallDelta:
    index: int  # which call of the reply (0, 1, ...)
    id: str | None = None  # set on a call's first delta only, with its name
    name: str | None = None
    arguments: str = ""  # text to append to the call's arguments


@dataclass(slots=True)
class ToolStreamDelta:
    content: str = ""  # text to append to the message's content
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag`` (held back
    while streaming: it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolParser:
    """Base class of the tool-call parsers; subclasses set ``name`` and implement ``scan``.

    ``tools``: the request's tools, as ``{name: parameters JSON schema or None}`` or a
    collection of names; a call of another name is text. ``None``: any name is taken.
    ``max_calls``: calls past this many are text (``parallel_tool_calls: false`` is 1).
    """

    name: ClassVar[str]  # what --tool-call-parser takes
    description: ClassVar[str] = ""  # the models that write this format (for --help)
    # (optional) default: False. The format's markers are special tokens, which the reply's
    # text keeps only when the request decodes with skip_special_tokens false.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: Mapping[str, Any] | Collection[str] | None = None,
                 max_calls: int | None = None) -> None:
        if tools is None or isinstance(tools, Mapping):
            self.tool_schemas: Mapping[str, Any] | None = tools
        else:
            self.tool_schemas = {name: None for name in tools}
        self.max_calls = max_calls
        # streaming state
        self._sent_content = 0
        self._sent_args: list[int] = []  # per streamed call: how much of its arguments went out
        self._text_len = 0
        # A call that breaks after its arguments began: streamed, it stays a call (its deltas
        # are out); parsed whole, it is text and takes no call's place (``parse`` sets False).
        self.keeps_broken_calls = True

    # -- the format's hook ---------------------------------------------------------------
    def scan(self, text: str, final: bool) -> list[str | ScannedCall]:
        """The reply so far (``final``: the whole reply) as content and calls, in order.
        Called with a growing text on one instance; may keep state between calls."""
        raise NotImplementedError

    # -- helpers for scan ----------------------------------------------------------------
    def is_over_limit(self, index: int) -> bool:
        """Whether the ``index``-th call is past ``max_calls``. Formats whose reply is nothing but
        calls drop such calls; formats with calls inside text leave them as text (``accepts``)."""
        return self.max_calls is not None and index >= self.max_calls

    def accepts(self, name: str, index: int) -> bool:
        """Whether the ``index``-th call (from 0) may be a call of ``name``."""
        if self.max_calls is not None and index >= self.max_calls:
            return False
        return self.tool_schemas is None or name in self.tool_schemas

    def parameters_schema(self, name: str) -> dict[str, Any]:
        """The ``properties`` of a tool's JSON schema (formats that write typed values as text)."""
        schema = (self.tool_schemas or {}).get(name)
        if isinstance(schema, dict):
            props = schema.get("properties", {})
            return props if isinstance(props, dict) else {}
        return {}

    def make_call_id(self) -> str:
        """(optional) default: ``chatcmpl-tool-<hex>``. A new call's id."""
        return f"chatcmpl-tool-{secrets.token_hex(16)}"

    # -- what the serving layer calls ------------------------------------------------------
    def parse_items(self, text: str) -> list[str | tuple[str, str]]:
        """The whole reply in order: content strings and ``(name, arguments JSON)`` calls. A call
        that is not written whole and valid is content, as the model wrote it."""
        self.keeps_broken_calls = False
        items: list[str | tuple[str, str]] = []
        for item in self.scan(text, True):
            if isinstance(item, str):
                items.append(item)
            elif item.is_complete:
                items.append((item.name, item.arguments))
            else:
                items.append(item.raw)
        return items

    def parse(self, text: str) -> ParsedCalls:
        """The calls in a whole reply, and the content left (``None`` if empty). A call
        that is not written whole and valid stays in the content as the model wrote it."""
        items = self.parse_items(text)
        calls = [item for item in items if isinstance(item, tuple)]
        if not calls:
            return text, []
        joined = "".join(item for item in items if isinstance(item, str)).strip()
        return joined or None, calls

    def stream(self, text: str, final: bool = False) -> ToolStreamDelta:
        """What to send after the reply grew to ``text`` (``final``: the reply is whole)."""
        pieces = self.stream_pieces(text, final)
        return ToolStreamDelta(content="".join(piece for piece in pieces if isinstance(piece, str)),
                               calls=[piece for piece in pieces if not isinstance(piece, str)])

    def stream_pieces(self, text: str, final: bool = False) -> list[str | ToolCallDelta]:
        """``stream``'s delta in the reply's order: each content string stands where the model
        wrote it relative to the calls (whitespace held back before a call may come out later,
        in front of text that follows the call)."""
        assert len(text) >= self._text_len, "stream() takes the whole reply so far, which only grows"
        self._text_len = len(text)
        items = self.scan(text, final)
        content = "".join(item for item in items if isinstance(item, str))
        has_calls = any(not isinstance(item, str) for item in items)
        # Whitespace at the end of the content waits: around calls ``parse`` strips it.
        if not final or has_calls:
            content = content.rstrip()
        pieces: list[str | ToolCallDelta] = []
        at, index = 0, 0  # where the next content item starts in ``content``; the next call's index
        for item in items:
            if isinstance(item, str):
                # the part of [at, at + len(item)) not sent yet and sendable now
                lo, hi = max(at, self._sent_content), min(at + len(item), len(content))
                if hi > lo:
                    pieces.append(content[lo:hi])
                at += len(item)
                continue
            if index == len(self._sent_args):
                self._sent_args.append(len(item.arguments))
                pieces.append(ToolCallDelta(index, self.make_call_id(), item.name, item.arguments))
            elif len(item.arguments) > self._sent_args[index]:
                pieces.append(ToolCallDelta(index, arguments=item.arguments[self._sent_args[index] :]))
                self._sent_args[index] = len(item.arguments)
            index += 1
        self._sent_content = max(self._sent_content, len(content))
        return pieces

    @property
    def num_streamed_calls(self) -> int:
        """How many calls ``stream`` has started (a streamed reply with any ends with 'tool_calls')."""
        return len(self._sent_args)

    @classmethod
    def parse_text(cls, text: str, tool_names: Collection[str] | Mapping[str, Any] | None = None,
                   max_calls: int | None = None) -> ParsedCalls:
        """``cls(tool_names, max_calls).parse(text)``: the function ``TOOL_PARSERS`` maps a name to."""
        return cls(tool_names, max_calls).parse(text)
