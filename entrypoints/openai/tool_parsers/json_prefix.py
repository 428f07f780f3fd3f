"""Incremental, canonical JSON: the text a model writes, re-serialized as it arrives.

A streamed call's arguments must be sent as deltas that concatenate to the final arguments,
yet the model's own spacing (``{"x" :1}``) is not what a client should get. ``JsonPrefix``
reads a JSON value's text char by char and writes it out with ``json.dumps``'s separators
(``", "`` and ``": "``, ``ensure_ascii=False``), so that

- the output only ever grows: each longer input extends the previous output (a delta is the
  new end), and a string's characters come out as they arrive;
- for whole, ordinary JSON (no duplicate keys, numbers written as Python writes them) the
  output is ``json.dumps(json.loads(text), ensure_ascii=False)``.

Numbers are kept as written (validated); lone UTF-16 surrogates stay ``\\uXXXX`` escapes;
NaN / Infinity and raw control characters in strings are errors (not JSON).
"""
from __future__ import annotations

import re

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_PLAIN_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_LITERALS = {"true": "true", "false": "false", "null": "null"}
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_WRITE_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_WHITESPACE = " \t\n\r"


def _write_char(c: str) -> str:
    if c in _WRITE_ESCAPES:
        return _WRITE_ESCAPES[c]
    if c < " " or "\ud800" <= c <= "\udfff":
        return f"\\u{ord(c):04x}"
    return c


class JsonPrefix:
    """Feed it a growing text (``feed(text, start)``: the value starts at ``text[start]``);
    ``output`` is the canonical form of what has been read. ``end`` is set (an index into
    ``text``) once the value is whole; ``error`` once the text cannot be JSON. Reading stops
    at either. ``members`` tracks a top-level object's members for call formats that wrap
    the arguments (``{"name": ..., "arguments": {...}}``)."""

    __slots__ = ("_pos", "_parts", "_len", "_stack", "_state", "_buf", "_key", "_is_key",
                 "_high", "_member", "end", "error", "members")

    def __init__(self) -> None:
        self._pos: int | None = None  # next index of the text to read
        self._parts: list[str] = []
        self._len = 0  # len of the output
        self._stack: list[str] = []  # the open containers, "{" or "["
        self._state = "value"
        self._buf = ""  # a number's or literal's characters, or a \\u escape's hex digits
        self._key: list[str] = []  # the decoded key being read (depth 1 only)
        self._is_key = False  # the string being read is a key
        self._high: str | None = None  # a high surrogate waiting for its low half
        self._member: str | None = None  # the depth-1 key whose value is being read
        self.end: int | None = None
        self.error = False
        # depth-1 members of a top-level object: key -> [output start, output end or None]
        self.members: dict[str, list[int | None]] = {}

    @property
    def output(self) -> str:
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def is_done(self) -> bool:
        return self.end is not None

    @property
    def first_char(self) -> str | None:
        out = self.output
        return out[0] if out else None

    def member_text(self, key: str) -> tuple[str, bool] | None:
        """The canonical text of a depth-1 member's value so far and whether it is whole."""
        span = self.members.get(key)
        if span is None:
            return None
        start, end = span
        assert start is not None
        return self.output[start:end], end is not None

    def _emit(self, s: str) -> None:
        self._parts.append(s)
        self._len += len(s)

    def feed(self, text: str, start: int = 0) -> JsonPrefix:
        if self._pos is None:
            self._pos = start
        pos = self._pos
        n = len(text)
        while pos < n and self.end is None and not self.error:
            pos = self._step(text, pos)
        self._pos = pos
        return self

    # -- the state machine: each step reads at least one character -----------------
    def _step(self, text: str, pos: int) -> int:
        c = text[pos]
        state = self._state
        if state == "string":
            run = _PLAIN_RUN.match(text, pos)
            if run is not None:
                self._flush_high()
                self._string_chars(run.group(), plain=True)
                return run.end()
            if c == '"':
                self._flush_high()
                self._emit('"')
                if self._is_key:
                    self._state = "colon"
                else:
                    self._value_done(pos + 1)
            elif c == "\\":
                self._state = "escape"
            else:  # a raw control character
                self.error = True
            return pos + 1
        if state == "escape":
            if c == "u":
                self._state, self._buf = "unicode", ""
            elif c in _SIMPLE_ESCAPES:
                self._flush_high()
                self._string_chars(_SIMPLE_ESCAPES[c])
                self._state = "string"
            else:
                self.error = True
            return pos + 1
        if state == "unicode":
            if c not in "0123456789abcdefABCDEF":
                self.error = True
                return pos + 1
            self._buf += c
            if len(self._buf) == 4:
                self._unicode(chr(int(self._buf, 16)))
                self._state = "string"
            return pos + 1
        if state in ("number", "literal"):
            if state == "number" and c in _NUMBER_CHARS or state == "literal" and c.isalpha():
                self._buf += c
                return pos + 1
            if state == "number":
                if not _NUMBER.fullmatch(self._buf):
                    self.error = True
                    return pos
                self._emit(self._buf)
            else:
                if self._buf not in _LITERALS:
                    self.error = True
                    return pos
                self._emit(self._buf)
            self._value_done(pos)
            return pos  # the terminator is read by the next step
        if c in _WHITESPACE:
            return pos + 1
        if state in ("value", "value_or_close"):
            if c == "]" and state == "value_or_close":
                self._close("[", pos)
            else:
                self._value_start(c)
            return pos + 1
        if state in ("key", "key_or_close"):
            if c == '"':
                self._emit('"')
                self._state, self._is_key, self._key = "string", True, []
            elif c == "}" and state == "key_or_close":
                self._close("{", pos)
            else:
                self.error = True
            return pos + 1
        if state == "colon":
            if c != ":":
                self.error = True
                return pos + 1
            self._emit(": ")
            if len(self._stack) == 1:
                self._member = "".join(self._key)
                self.members.setdefault(self._member, [self._len, None])
            self._state = "value"
            return pos + 1
        if state == "after_value":
            top = self._stack[-1]
            if c == ",":
                self._emit(", ")
                self._state = "key" if top == "{" else "value"
            elif c == "}" and top == "{" or c == "]" and top == "[":
                self._close(top, pos)
            else:
                self.error = True
            return pos + 1
        raise AssertionError(state)

    def _value_start(self, c: str) -> None:
        self._is_key = False
        if c == "{":
            self._emit("{")
            self._stack.append("{")
            self._state = "key_or_close"
        elif c == "[":
            self._emit("[")
            self._stack.append("[")
            self._state = "value_or_close"
        elif c == '"':
            self._emit('"')
            self._state = "string"
        elif c == "-" or c.isdigit():
            self._state, self._buf = "number", c
        elif c in "tfn":
            self._state, self._buf = "literal", c
        else:
            self.error = True

    def _string_chars(self, s: str, plain: bool = False) -> None:
        if self._is_key and len(self._stack) == 1:
            self._key.append(s)
        self._emit(s if plain else "".join(_write_char(c) for c in s))

    def _unicode(self, ch: str) -> None:
        if self._high is not None:
            if "\udc00" <= ch <= "\udfff":
                pair = (ord(self._high) - 0xD800) * 0x400 + (ord(ch) - 0xDC00) + 0x10000
                self._high = None
                self._string_chars(chr(pair))
                return
            self._flush_high()
        if "\ud800" <= ch <= "\udbff":
            self._high = ch
        else:
            self._string_chars(ch)

    def _flush_high(self) -> None:
        if self._high is not None:
            high, self._high = self._high, None
            self._string_chars(high)

    def _close(self, opener: str, pos: int) -> None:
        self._stack.pop()
        self._emit("}" if opener == "{" else "]")
        self._value_done(pos + 1)

    def _value_done(self, end: int) -> None:
        depth = len(self._stack)
        if depth == 0:
            self.end = end
            self._state = "done"
            return
        if depth == 1 and self._member is not None and self._stack[0] == "{":
            span = self.members[self._member]
            if span[1] is None:
                span[1] = self._len
            self._member = None
        self._state = "after_value"
