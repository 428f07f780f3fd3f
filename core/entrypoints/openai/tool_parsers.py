"""Tool-call parsers for ``tool_choice="auto"``: they find the calls a model wrote in its own
format in the generated text (``halserve serve --enable-auto-tool-choice --tool-call-parser
NAME``, vLLM's flags). Forced calls (``"required"`` or a named function) need no parser: they
are generated to the tools' JSON schema (``constraints``)."""
from __future__ import annotations

import json
import re
from typing import Callable

# (content left for the message or None, [(function name, arguments as JSON text)])
ParsedCalls = tuple[str | None, list[tuple[str, str]]]

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> ParsedCalls:
    """Hermes / Qwen2.5 / Qwen3 format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    blocks, anywhere in the text. A block that is not such JSON stays in the content."""
    calls: list[tuple[str, str]] = []
    kept: list[str] = []
    last = 0
    for match in _HERMES_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append((call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
        kept.append(text[last : match.start()])
        last = match.end()
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


TOOL_PARSERS: dict[str, Callable[[str], ParsedCalls]] = {"hermes": parse_hermes}
