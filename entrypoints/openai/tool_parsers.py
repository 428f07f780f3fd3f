"""Tool-call parsers for ``tool_choice="auto"``: they find the calls a model wrote in its own
format in the generated text (``halserve serve --enable-auto-tool-choice --tool-call-parser
NAME``, vLLM's flags). Forced calls (``"required"`` or a named function) need no parser: they
are generated to the tools' JSON schema (``constraints``)."""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection

# (content left for the message or None, [(function name, arguments as JSON text)])
ParsedCalls = tuple[str | None, list[tuple[str, str]]]

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _strict_json(text: str) -> object:
    """``json.loads`` without the NaN / Infinity extensions (not JSON: clients cannot parse them)."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _arguments(call: dict) -> str | None:
    """A call's arguments as JSON object text, or None if they are not a JSON object."""
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # (some models write the object as a JSON string)
        try:
            arguments = _strict_json(arguments)
        except ValueError:
            return None
    return json.dumps(arguments, ensure_ascii=False) if isinstance(arguments, dict) else None


def parse_hermes(text: str, tool_names: Collection[str] | None = None, max_calls: int | None = None) -> ParsedCalls:
    """Hermes / Qwen2.5 / Qwen3 format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    blocks, anywhere in the text. A block that is not such a call (not JSON, a name not among
    ``tool_names``, arguments that are not an object), or past ``max_calls``, stays in the content."""
    calls: list[tuple[str, str]] = []
    kept: list[str] = []
    last = 0
    for match in _HERMES_CALL.finditer(text):
        if max_calls is not None and len(calls) >= max_calls:
            break
        try:
            call = _strict_json(match.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = _arguments(call)
        if arguments is None or (tool_names is not None and call["name"] not in tool_names):
            continue
        calls.append((call["name"], arguments))
        kept.append(text[last : match.start()])
        last = match.end()
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


# parser(text, the tools' names, at most this many calls or None)
TOOL_PARSERS: dict[str, Callable[[str, Collection[str] | None, int | None], ParsedCalls]] = {"hermes": parse_hermes}
