"""Mistral: ``[TOOL_CALLS]`` and then the calls, in one of the layouts Mistral's tokenizers use:

- v3 (Mistral 7B v0.3, Mixtral): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``
- v11 (Mistral Small 3, Nemo after tokenizer v11): ``[TOOL_CALLS]name{...}``, one marker per call
- v13 (Magistral, Devstral): ``[TOOL_CALLS]name[ARGS]{...}``

``[TOOL_CALLS]`` is a special token: the request decodes with ``skip_special_tokens`` false so
that the reply keeps it. Text before the first marker is content; call ids are 9 letters and
digits, as Mistral's chat templates require."""
from __future__ import annotations

import re
import secrets
import string

from halserve.entrypoints.openai.tool_parsers.base import ScannedCall, ToolParser, partial_suffix
from halserve.entrypoints.openai.tool_parsers.json_call import CALL, PENDING, read_call_object
from halserve.entrypoints.openai.tool_parsers.json_prefix import JsonPrefix

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ALPHANUMERIC = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    description = "[TOOL_CALLS]...: Mistral, Mixtral, Mistral Small/Nemo, Magistral, Devstral"
    needs_special_tokens = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lexers: dict[int, JsonPrefix] = {}

    def make_call_id(self) -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def scan(self, text: str, final: bool) -> list[str | ScannedCall]:
        k = text.find(BOT)
        if k < 0:
            head = text if final else text[: len(text) - partial_suffix(text, BOT)]
            return [head] if head else []
        items: list[str | ScannedCall] = [text[:k]] if k else []
        calls = 0
        pos = k + len(BOT)
        while True:
            j = _skip_space(text, pos)
            if j == len(text):
                if final and calls == 0:
                    items.append(text[k:])  # a marker and nothing after it
                return items
            if text[j] == "[":  # v3: a JSON array of call objects
                return self._scan_array(text, j + 1, final, items, k)
            if self.is_over_limit(calls):
                return items
            refused = text[j if calls else k :]  # (a call that is not one, and all after it: text)
            name = _NAME.match(text, j)
            if name is None:
                return [*items, refused]
            after = text[name.end() :]
            if not final and (not after or len(after) < len(ARGS) and ARGS.startswith(after)):
                return items  # the name, or [ARGS], is still being written
            args_at = _skip_space(text, name.end() + (len(ARGS) if after.startswith(ARGS) else 0))
            if args_at == len(text) and not final:
                return items
            if args_at == len(text) or text[args_at] != "{" or not self.accepts(name.group(), calls):
                return [*items, refused]
            lexer = self._lexers.setdefault(args_at, JsonPrefix()).feed(text, args_at)
            if lexer.error and not self.keeps_broken_calls or final and lexer.end is None and \
                    not self.keeps_broken_calls:
                return [*items, refused]
            items.append(ScannedCall(name.group(), lexer.output, lexer.end is not None, text[j:]))
            calls += 1
            if lexer.end is None:
                return items
            rest = text[lexer.end :]
            stripped = rest.lstrip()
            if stripped.startswith(BOT):
                pos = len(text) - len(stripped) + len(BOT)
                continue
            if not final and BOT.startswith(stripped):
                return items
            return [*items, rest]  # text after the calls

    def _scan_array(self, text: str, pos: int, final: bool, items: list[str | ScannedCall],
                    k: int) -> list[str | ScannedCall]:
        """v3's array from ``pos`` (past its ``[``). Unless it is a whole list of calls, the
        reply from the marker on is text (the calls already streamed stay)."""
        first = len(items)

        def refuse() -> list[str | ScannedCall]:
            if self.keeps_broken_calls and len(items) > first:
                return items
            return [*items[:first], text[k:]]

        while True:
            pos = _skip_space(text, pos)
            if pos == len(text):
                return refuse() if final else items
            if text[pos] != "{":
                return refuse()
            if self.is_over_limit(len(items) - first):
                return items
            lexer = self._lexers.setdefault(pos, JsonPrefix())
            read = read_call_object(lexer, text, pos, final, lambda name: self.accepts(name, len(items) - first))
            if read.status == PENDING and not final:
                return items
            if read.status != CALL:
                return refuse()
            if read.end is None and (final or read.is_broken):
                if self.keeps_broken_calls:
                    items.append(ScannedCall(read.name, read.arguments, False, text[pos:]))
                return refuse()
            items.append(ScannedCall(read.name, read.arguments, read.end is not None, text[pos:]))
            if read.end is None:
                return items
            pos = _skip_space(text, read.end)
            if pos == len(text):
                return refuse() if final else items
            if text[pos] == "]":
                rest = text[pos + 1 :]
                return [*items, rest] if rest.strip() else items
            if text[pos] != ",":
                return refuse()
            pos += 1


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
