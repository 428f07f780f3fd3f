"""Llama 3.1 / 3.2 / 3.3 JSON calls: the reply is the calls, each
``{"name": ..., "parameters": {...}}`` (``"arguments"`` taken too), several separated by ``;``,
optionally after ``<|python_tag|>``. A reply that does not open with a call is text."""
from __future__ import annotations

from halserve.entrypoints.openai.tool_parsers.base import ScannedCall, ToolParser
from halserve.entrypoints.openai.tool_parsers.json_call import CALL, PENDING, read_call_object
from halserve.entrypoints.openai.tool_parsers.json_prefix import JsonPrefix

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    description = '{"name": ..., "parameters": {...}}: Llama 3.1, 3.2, 3.3'

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lexers: dict[int, JsonPrefix] = {}

    def scan(self, text: str, final: bool) -> list[str | ScannedCall]:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].lstrip()
        elif PYTHON_TAG.startswith(body) and body and not final:
            return []  # maybe the tag
        if not body:
            return [] if not final else [text] if text else []
        if body[0] != "{":
            return [text]
        items: list[str | ScannedCall] = []
        pos = len(text) - len(body)
        start = pos
        while True:
            if self.is_over_limit(len(items)):
                return items
            lexer = self._lexers.setdefault(pos, JsonPrefix())
            read = read_call_object(lexer, text, pos, final, lambda name: self.accepts(name, len(items)))
            if read.status == PENDING and not final:
                return items
            if read.status != CALL or (read.is_broken and not self.keeps_broken_calls):
                # from the first object that is no call on, the reply is text
                items.append(text[start if not items else pos :])
                return items
            if read.end is None:  # growing, or broken
                items.append(ScannedCall(read.name, read.arguments, False, text[pos:]))
                return items
            items.append(ScannedCall(read.name, read.arguments, True, text[pos : read.end]))
            rest = text[read.end :]
            stripped = rest.lstrip(" \t\r\n;")
            if not stripped:
                return items
            if stripped[0] != "{":
                items.append(rest)  # text after the calls
                return items
            pos = len(text) - len(stripped)
