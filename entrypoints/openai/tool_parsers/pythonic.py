"""Pythonic calls (Llama 3.2 / Llama 4, ToolACE, and models prompted so): the reply is a Python
list of calls with keyword arguments, ``[get_weather(city='Paris', days=3), get_time()]``,
values being Python literals; Llama 4 may wrap it in ``<|python_start|>...<|python_end|>``.
A reply that is not such a list is text.

Streamed, a call's name goes out at its ``(``, and each argument once its value is whole (a
value is a Python literal, read by ``ast.literal_eval``)."""
from __future__ import annotations

import ast
import json
import re

from halserve.entrypoints.openai.tool_parsers.base import ScannedCall, ToolParser

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_KEYWORD = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=")
_OPEN, _CLOSE = "([{", ")]}"


def _value_end(text: str, pos: int) -> int | None:
    """Index of the ``,`` or ``)`` that ends the argument value starting at ``pos`` (brackets and
    strings skipped), or None if the text ends first."""
    depth, quote, i = 0, "", pos
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if text.startswith(quote, i):
                i += len(quote)
                quote = ""
                continue
        elif c in "'\"":
            quote = c * 3 if text.startswith(c * 3, i) else c
            i += len(quote)
            continue
        elif c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            if depth == 0:
                return i if c == ")" else -1
            depth -= 1
        elif c == "," and depth == 0:
            return i
        i += 1
    return None


class PythonicToolParser(ToolParser):
    name = "pythonic"
    description = "[f(x=1), g()]: Llama 3.2, Llama 4, ToolACE"

    def parse(self, text: str):  # type: ignore[no-untyped-def]
        # all or nothing: the reply is a list of calls, or it is text
        content, calls = super().parse(text)
        if calls and content is not None and content.strip() not in ("", PYTHON_END):
            return text, []
        return (None, calls) if calls else (text, [])

    def scan(self, text: str, final: bool) -> list[str | ScannedCall]:
        body = text.lstrip()
        if body.startswith(PYTHON_START):
            body = body[len(PYTHON_START) :].lstrip()
        elif body and PYTHON_START.startswith(body) and not final:
            return []
        if not body:
            return [text] if final and text else []
        if body[0] != "[":
            return [text]
        items: list[str | ScannedCall] = []
        pos = len(text) - len(body) + 1

        def refuse() -> list[str | ScannedCall]:
            if items and self.keeps_broken_calls:
                return items
            return [text]

        while True:
            pos = _skip_space(text, pos)
            if pos == len(text):
                return refuse() if final else items
            if text[pos] == "]" and not items:
                return refuse()  # an empty list is no call
            if self.is_over_limit(len(items)):
                return items
            name = _IDENT.match(text, pos)
            if name is None:
                return refuse()
            if name.end() == len(text):
                return refuse() if final else items
            if text[name.end()] != "(" or not self.accepts(name.group(), len(items)):
                return refuse()
            args, pos, state = self._arguments(text, name.end() + 1)
            if state == "pending" and not final:
                return items
            if state in ("pending", "refused"):
                return refuse()
            if state == "broken" or state == "growing" and final:
                if self.keeps_broken_calls:  # (its name went out at its "(")
                    items.append(ScannedCall(name.group(), args, False, text[name.start() :]))
                return refuse()
            items.append(ScannedCall(name.group(), args, state == "whole", text[name.start() : pos]))
            if state == "growing":
                return items
            pos = _skip_space(text, pos)
            if pos == len(text):
                return refuse() if final else items
            if text[pos] == ",":
                pos += 1
                continue
            if text[pos] != "]":
                return refuse()
            tail = text[pos + 1 :].strip()
            if tail and tail != PYTHON_END and not (not final and PYTHON_END.startswith(tail)):
                return refuse()
            return items

    def _arguments(self, text: str, pos: int) -> tuple[str, int, str]:
        """The canonical JSON of the keyword arguments from ``pos`` (past the ``(``) as far as
        they are whole, where reading stopped, and the state: "whole" (the call closed),
        "growing", "broken" (not keyword arguments with literal values); before the first
        keyword is read, "pending" or "refused" (the call is not reported yet)."""
        parts: list[str] = []

        def so_far(state: str) -> tuple[str, int, str]:
            if not parts and state != "whole" and _KEYWORD.match(text, pos) is None:
                state = "pending" if state == "growing" else "refused"  # nothing of a call yet
            return "{" + ", ".join(parts) + ("}" if state == "whole" else ""), pos, state

        while True:
            pos = _skip_space(text, pos)
            if pos == len(text):
                return so_far("growing")
            if text[pos] == ")":
                pos += 1
                return so_far("whole")
            keyword = _KEYWORD.match(text, pos)
            if keyword is None:  # a keyword still being written, or no keyword
                return so_far("growing" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\s*", text[pos:]) else "broken")
            end = _value_end(text, keyword.end())
            if end is None:
                return so_far("growing")
            if end < 0:
                return so_far("broken")
            try:
                value = ast.literal_eval(text[keyword.end() : end].strip())
                encoded = json.dumps(value, ensure_ascii=False, allow_nan=False)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return so_far("broken")
            parts.append(f"{json.dumps(keyword.group(1))}: {encoded}")
            pos = end + 1 if text[end] == "," else end


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
