"""Qwen3-Coder (and Qwen3.5 / Qwen3-Next in coder mode): XML-style calls,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is text: it becomes the JSON type the tool's schema gives it (integer,
number, boolean, object/array; ``null`` for a non-string), otherwise a string. A string value
streams as it is written; others go out once whole."""
from __future__ import annotations

import ast
import json
from typing import Any

from halserve.entrypoints.openai.tool_parsers.base import ScannedCall, ToolParser, partial_suffix

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


def _schema_type(schema: Any) -> str:
    if isinstance(schema, dict) and "type" in schema:
        kind = schema["type"]
        if isinstance(kind, list):  # ["string", "null"]
            kind = next((k for k in kind if k != "null"), "string")
        return str(kind).strip().lower()
    return "string" if schema is not None else "unknown"


def convert_value(value: str, kind: str) -> Any:
    """A parameter's text as the JSON value its schema type says; the text itself if it does
    not read as that type (as vLLM's qwen3_coder parser does)."""
    if kind in _STRING_TYPES:
        return value
    if value.strip().lower() == "null":
        return None
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value.strip())
        except ValueError:
            return value
    if kind.startswith(("num", "float", "double")):
        try:
            number = float(value.strip())
        except ValueError:
            return value
        if number != number or number in (float("inf"), float("-inf")):
            return value
        return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
    if kind in ("boolean", "bool", "binary"):
        lowered = value.strip().lower()
        return lowered == "true" if lowered in ("true", "false") else value
    if kind == "unknown" or kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except ValueError:
            pass
        try:
            literal = ast.literal_eval(value.strip())
            json.dumps(literal, allow_nan=False)
            return literal
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return value
    return value


def _json_string_body(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    description = "<tool_call><function=f><parameter=p>...: Qwen3-Coder"

    def scan(self, text: str, final: bool) -> list[str | ScannedCall]:
        items: list[str | ScannedCall] = []
        pos, index = 0, 0
        while True:
            k = text.find(START, pos)
            if k < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - partial_suffix(tail, START)]
                return [*items, tail] if tail else items
            if k > pos:
                items.append(text[pos:k])
            close = text.find(END, k)
            block_end = len(text) if close < 0 else close + len(END)
            f = _skip_space(text, k + len(START))
            rest = text[f:]
            if not rest.startswith(FUNCTION):
                if not final and FUNCTION.startswith(rest):
                    return items
                items.append(text[k:block_end])
                pos = block_end
                continue
            name_end = text.find(">", f)
            if name_end < 0:
                if final:
                    return [*items, text[k:]]
                return items
            name = text[f + len(FUNCTION) : name_end].strip()
            if not name or not self.accepts(name, index):
                items.append(text[k:block_end])
                pos = block_end
                continue
            arguments, end, state = self._parameters(text, name_end + 1, name, final)
            if state == "broken" or state == "growing" and final:
                if not self.keeps_broken_calls:
                    items.append(text[k:block_end])
                    pos = block_end
                    continue
                items.append(ScannedCall(name, arguments, False, text[k:]))
                return items  # (the rest of a broken block is dropped: its deltas are out)
            if state == "growing":
                items.append(ScannedCall(name, arguments, False, text[k:]))
                return items
            # the function closed: then </tool_call> (or, at the very end, nothing)
            after = text[end:].lstrip()
            if after.startswith(END):
                block_end = len(text) - len(after) + len(END)
            elif not final and END.startswith(after):
                items.append(ScannedCall(name, arguments, False, text[k:]))
                return items
            elif not (final and not after):
                if not self.keeps_broken_calls:
                    items.append(text[k:block_end])
                    pos = block_end
                    continue
                block_end = end
            else:
                block_end = len(text)
            items.append(ScannedCall(name, arguments, True, text[k:block_end]))
            index += 1
            pos = block_end

    def _parameters(self, text: str, pos: int, name: str, final: bool) -> tuple[str, int, str]:
        """The canonical arguments from ``pos`` (past ``<function=NAME>``): ``(arguments so far,
        where the function ended, state)`` with state "whole", "growing" or "broken"."""
        schema = self.parameters_schema(name)
        parts: list[str] = []

        def so_far(state: str, partial: str = "") -> tuple[str, int, str]:
            joined = ", ".join([*parts, partial] if partial else parts)
            return "{" + joined + ("}" if state == "whole" else ""), pos, state

        while True:
            pos = _skip_space(text, pos)
            rest = text[pos:]
            if rest.startswith(FUNCTION_END):
                pos += len(FUNCTION_END)
                return so_far("whole")
            if not rest.startswith(PARAMETER):
                if not final and (PARAMETER.startswith(rest) or FUNCTION_END.startswith(rest)):
                    return so_far("growing")
                return so_far("broken")
            key_end = text.find(">", pos)
            if key_end < 0:
                return so_far("growing")
            key = text[pos + len(PARAMETER) : key_end].strip()
            kind = _schema_type(schema.get(key)) if schema else "unknown"
            value_at = key_end + 1
            # the value ends at </parameter>; a model that leaves it out ends it at the next
            # parameter or at </function>
            ends = [(text.find(tag, value_at), tag) for tag in (PARAMETER_END, PARAMETER, FUNCTION_END)]
            found = [(at, tag) for at, tag in ends if at >= 0]
            head = f"{json.dumps(key, ensure_ascii=False)}: "
            if not found:
                if kind in _STRING_TYPES:
                    value = text[value_at:]
                    for tag in (PARAMETER_END, PARAMETER, FUNCTION_END):
                        value = value[: len(value) - partial_suffix(value, tag)]
                    value = value.removeprefix("\n")
                    if value.endswith("\n"):
                        value = value[:-1]  # (it may be the newline before </parameter>)
                    if text[value_at:]:
                        return so_far("growing", head + '"' + _json_string_body(value))
                return so_far("growing")
            at, tag = min(found)
            value = text[value_at:at].removeprefix("\n").removesuffix("\n")
            parts.append(head + json.dumps(convert_value(value, kind), ensure_ascii=False))
            pos = at + (len(PARAMETER_END) if tag == PARAMETER_END else 0)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
