"""Reading one ``{"name": ..., "arguments": {...}}`` call object as it is written (hermes,
llama3_json and mistral's older format share it)."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from halserve.entrypoints.openai.tool_parsers.json_prefix import JsonPrefix

PENDING = "pending"  # not known yet: hold the text back
TEXT = "text"  # not a call: the text is content
CALL = "call"  # a call (arguments may still be growing)


@dataclass(slots=True)
class CallRead:
    status: str  # PENDING, TEXT or CALL
    name: str = ""
    arguments: str = ""  # canonical, so far
    end: int | None = None  # CALL: index just past the object once it is whole and valid
    is_broken: bool = False  # CALL: the text stopped being JSON (or the arguments an object)


def whole_object(text: str) -> str | None:
    """The canonical text of ``text`` if it is exactly one JSON object (spaces around allowed)."""
    lexer = JsonPrefix().feed(text, len(text) - len(text.lstrip()))
    if lexer.error or lexer.end is None or lexer.first_char != "{" or text[lexer.end :].strip():
        return None
    return lexer.output


def read_call_object(lexer: JsonPrefix, text: str, start: int, final: bool, accepts: Callable[[str], bool],
                     argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> CallRead:
    """Read (further) the call object at ``text[start] == "{"`` with ``lexer`` (one per object,
    kept by the caller between growing texts). A call's arguments are an object, or a JSON
    string holding one (read whole); a call without them has ``{}``."""
    lexer.feed(text, start)
    name_read = lexer.member_text("name")
    name: str | None = None
    if name_read is not None and name_read[1]:
        value = json.loads(name_read[0])
        if not isinstance(value, str) or not accepts(value):
            return CallRead(TEXT)
        name = value
    elif lexer.is_done or lexer.error:
        return CallRead(TEXT)  # no name
    key = next((k for k in argument_keys if k in lexer.members), None)
    args_read = lexer.member_text(key) if key is not None else None
    if args_read is None:
        if lexer.error:
            return CallRead(TEXT)
        if name is None or not lexer.is_done:
            return CallRead(PENDING)
        return CallRead(CALL, name, "{}", lexer.end)
    args, args_whole = args_read
    if not args:  # the value has not begun (or a number or literal is being read)
        return CallRead(TEXT if lexer.error or lexer.is_done else PENDING)
    if args[0] == '"':  # arguments written as a JSON string: read once whole
        if not args_whole:
            return CallRead(TEXT if lexer.error else PENDING)
        inner = whole_object(json.loads(args))
        if inner is None:
            return CallRead(TEXT)
        args = inner
    elif args[0] != "{":
        return CallRead(TEXT)
    if name is None:
        return CallRead(TEXT if lexer.error or lexer.is_done else PENDING)
    if lexer.error:
        return CallRead(CALL, name, args, is_broken=True)
    return CallRead(CALL, name, args, lexer.end)
