"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks, anywhere in the reply, text around them."""
from __future__ import annotations

from halserve.entrypoints.openai.tool_parsers.base import ScannedCall, ToolParser, partial_suffix
from halserve.entrypoints.openai.tool_parsers.json_call import CALL, PENDING, TEXT, read_call_object
from halserve.entrypoints.openai.tool_parsers.json_prefix import JsonPrefix

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    description = "<tool_call>{...}</tool_call>: Hermes, Qwen2.5, Qwen3"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lexers: dict[int, JsonPrefix] = {}

    def scan(self, text: str, final: bool) -> list[str | ScannedCall]:
        items: list[str | ScannedCall] = []
        pos, index = 0, 0
        while True:
            k = text.find(START, pos)
            if k < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - partial_suffix(tail, START)]
                if tail:
                    items.append(tail)
                return items
            if k > pos:
                items.append(text[pos:k])
            body = k + len(START)
            close = text.find(END, body)
            block_end = len(text) if close < 0 else close + len(END)
            j = body
            while j < len(text) and text[j].isspace():
                j += 1
            if j == len(text) or text[j] != "{":
                if j == len(text) and not final:
                    return items  # nothing written yet
                items.append(text[k:block_end])
                pos = block_end
                continue
            lexer = self._lexers.setdefault(j, JsonPrefix())
            read = read_call_object(lexer, text, j, final, lambda name, i=index: self.accepts(name, i))
            if read.status == PENDING and not final:
                return items
            if read.status in (PENDING, TEXT):
                items.append(text[k:block_end])
                pos = block_end
                continue
            assert read.status == CALL
            complete, pending = False, False
            if read.end is not None:
                close = text.find(END, read.end)
                block_end = len(text) if close < 0 else close + len(END)
                rest = text[read.end :].lstrip()
                if rest.startswith(END):
                    complete = True
                    block_end = len(text) - len(rest) + len(END)
                elif not final and END.startswith(rest):
                    pending = True
            elif not read.is_broken and not final:
                pending = True
            if not (complete or pending or self.keeps_broken_calls):
                items.append(text[k:block_end])
                pos = block_end
                continue
            items.append(ScannedCall(read.name, read.arguments, complete, text[k:block_end]))
            index += 1
            if not complete and block_end == len(text):
                return items
            pos = block_end
