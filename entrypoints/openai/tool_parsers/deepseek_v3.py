"""DeepSeek-V3 (and V3.1): calls between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``,
each ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``
(V3.1 writes ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``). Text before the
calls is content."""
from __future__ import annotations

from halserve.entrypoints.openai.tool_parsers.base import ScannedCall, ToolParser, partial_suffix
from halserve.entrypoints.openai.tool_parsers.json_prefix import JsonPrefix

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    description = "<｜tool▁calls▁begin｜>...: DeepSeek-V3, DeepSeek-R1-0528, DeepSeek-V3.1"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lexers: dict[int, JsonPrefix] = {}

    def scan(self, text: str, final: bool) -> list[str | ScannedCall]:
        k = text.find(CALLS_BEGIN)
        if k < 0:
            head = text if final else text[: len(text) - partial_suffix(text, CALLS_BEGIN)]
            return [head] if head else []
        items: list[str | ScannedCall] = [text[:k]] if k else []
        pos = k + len(CALLS_BEGIN)
        while True:
            j = _skip_space(text, pos)
            rest = text[j:]
            if rest.startswith(CALLS_END):
                tail = text[j + len(CALLS_END) :]
                return [*items, tail] if tail.strip() else items
            if not rest.startswith(CALL_BEGIN):
                if not final and (CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest)):
                    return items
                return self._refuse(items, text, k, j)
            index = sum(isinstance(i, ScannedCall) for i in items)
            if self.is_over_limit(index):
                return items
            call = self._read_call(text, j, final, index)
            if call is None:  # still being written
                return items if not final else self._refuse(items, text, k, j)
            if isinstance(call, str):
                return self._refuse(items, text, k, j)
            scanned, end = call
            items.append(scanned)
            if end is None:
                return items
            pos = end

    def _refuse(self, items: list[str | ScannedCall], text: str, k: int, j: int) -> list[str | ScannedCall]:
        """From a block that is no call on, text: from that block if a call came before it
        (streamed calls stay; parsed whole, all from the marker)."""
        calls = [item for item in items if isinstance(item, ScannedCall)]
        if calls and self.keeps_broken_calls:
            return [*items, text[j:]]
        return [*(item for item in items if isinstance(item, str)), text[k:]]

    def _read_call(self, text: str, j: int, final: bool, index: int
                   ) -> tuple[ScannedCall, int | None] | str | None:
        """The call at ``text[j:]`` (``<｜tool▁call▁begin｜>...``): ``(call, end or None while
        growing)``, ``None`` while it cannot be told yet, or ``"text"`` if it is no call."""
        head = j + len(CALL_BEGIN)
        sep = text.find(SEP, head)
        if sep < 0:
            return None
        kind = text[head:sep].strip()
        if kind == "function":  # V3: the name on its line, then a fenced JSON object
            line_end = text.find("\n", sep)
            if line_end < 0:
                return None
            name = text[sep + len(SEP) : line_end].strip()
            fence = _skip_space(text, line_end)
            if len(text) - fence < len(FENCE_OPEN):
                return None if FENCE_OPEN.startswith(text[fence:]) else "text"
            if not text.startswith(FENCE_OPEN, fence):
                return "text"
            args_at = _skip_space(text, fence + len(FENCE_OPEN))
            closer = FENCE_CLOSE
        else:  # V3.1: the name before the separator, the object after it
            name = kind
            args_at = _skip_space(text, sep + len(SEP))
            closer = ""
        if args_at == len(text):
            return None
        if text[args_at] != "{" or not name or not self.accepts(name, index):
            return "text"
        lexer = self._lexers.setdefault(args_at, JsonPrefix()).feed(text, args_at)
        if lexer.error and not self.keeps_broken_calls:
            return "text"
        if lexer.end is None:
            if final and not self.keeps_broken_calls:
                return "text"
            return ScannedCall(name, lexer.output, False, text[j:]), None
        after = _skip_space(text, lexer.end)
        tail = closer + CALL_END if closer else CALL_END
        # (a fence's ``` and the end marker may have space between them)
        rest = text[after:]
        if closer and rest.startswith(closer):
            rest = rest[len(closer) :].lstrip()
        if rest.startswith(CALL_END):
            end = len(text) - len(rest) + len(CALL_END)
            return ScannedCall(name, lexer.output, True, text[j:end]), end
        if not final and (tail.startswith(text[after:]) or CALL_END.startswith(rest)):
            return ScannedCall(name, lexer.output, False, text[j:]), None
        if not self.keeps_broken_calls:
            return "text"
        return ScannedCall(name, lexer.output, False, text[j:]), None


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
