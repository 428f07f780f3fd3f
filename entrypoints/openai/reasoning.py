"""Reasoning parsers (``halserve serve --reasoning-parser NAME``, vLLM's flag): a thinking
model's ``<think> ... </think>`` goes to the message's ``reasoning`` field (and
``reasoning_content``, its older name), the text after it to ``content``.

Where the reply starts is read off the rendered prompt: a prompt that leaves a think block open
(DeepSeek-R1's and Qwen3-Thinking's templates end with ``<think>``) starts it inside the
reasoning; one that ends with a closed, empty block (Qwen3 with ``enable_thinking: false``)
starts it in the content; otherwise the parser's default holds (DeepSeek-R1 always thinks;
Qwen3 thinks if it opens with ``<think>``)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class ReplyStart(Enum):
    REASONING = "reasoning"  # the reply opens inside a think block
    CONTENT = "content"  # thinking is off: the reply is all content
    MAYBE = "maybe"  # reasoning if the reply opens with the start tag


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag`` (held back while
    streaming: it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass(frozen=True)
class ThinkTagParser:
    default: ReplyStart
    start_tag: str = "<think>"
    end_tag: str = "</think>"

    def reply_start(self, prompt: str) -> ReplyStart:
        """Only the prompt's end counts (a tag a user wrote in a message is text)."""
        tail = prompt.rstrip()
        if tail.endswith(self.start_tag):
            return ReplyStart.REASONING
        if tail.endswith(self.end_tag):
            body = tail[: -len(self.end_tag)].rstrip()
            if body.endswith(self.start_tag):  # an empty think block: thinking is off
                return ReplyStart.CONTENT
        return self.default

    def split(self, text: str, start: ReplyStart, final: bool = True, exact: bool = False
              ) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a reply's text. While streaming (``final`` false) what may
        still turn into a tag is held back, so each call's parts extend the previous call's.
        The content's leading whitespace is dropped unless ``exact`` (a constraint generated it)."""
        if start is ReplyStart.CONTENT:
            return None, text
        body = text.lstrip()
        if body.startswith(self.start_tag):
            body = body[len(self.start_tag) :]
        elif not final and self.start_tag.startswith(body):
            return None, None  # nothing yet, or the start of the start tag
        elif start is ReplyStart.MAYBE:
            return None, text
        body = body.lstrip()
        end = body.find(self.end_tag)
        if end < 0:
            if not final:
                body = body[: len(body) - _partial_suffix(body, self.end_tag)]
            return body or None, None
        content = body[end + len(self.end_tag) :]
        return body[:end] or None, (content if exact else content.lstrip()) or None


REASONING_PARSERS: dict[str, ThinkTagParser] = {
    "deepseek_r1": ThinkTagParser(ReplyStart.REASONING),
    "qwen3": ThinkTagParser(ReplyStart.MAYBE),
}


def _plugin_reasoning_parsers() -> dict[str, tuple[Any, str]]:
    """The parsers of loaded plugins (their ``halserve_reasoning_parsers``), checked."""
    from halserve.plugins import get_plugin_manager

    manager = get_plugin_manager()
    found: dict[str, tuple[Any, str]] = {}
    for record in manager.records:
        if record.status != "loaded" or not manager.implements(record.name, "halserve_reasoning_parsers"):
            continue
        for result in manager.call_plugin_hook(record.name, "halserve_reasoning_parsers"):
            if not isinstance(result, dict):
                raise TypeError(f"halserve_reasoning_parsers of plugin {record.name!r} must return a dict "
                                f"{{name: parser}}, got {type(result).__name__}")
            for name, parser in result.items():
                missing = [m for m in ("reply_start", "split") if not callable(getattr(parser, m, None))]
                if missing:
                    raise TypeError(f"plugin {record.name!r}: reasoning parser {name!r} has no "
                                    f"{' or '.join(missing)} method (see ThinkTagParser)")
                if name in REASONING_PARSERS or name in found:
                    raise TypeError(f"plugin {record.name!r}: reasoning parser {name!r} is already registered "
                                    f"by {found[name][1] if name in found else 'halserve (built-in)'}")
                found[name] = (parser, f"plugin {record.name!r}")
    return found


def reasoning_parser_names() -> list[str]:
    """Every name ``--reasoning-parser`` takes, sorted."""
    try:
        plugins = _plugin_reasoning_parsers()
    except TypeError:
        plugins = {}
    return sorted({*REASONING_PARSERS, *plugins})


def get_reasoning_parser(name: str) -> Any:
    """The reasoning parser ``name`` means (built-in or a plugin's); ``ValueError`` listing the
    names when there is none."""
    if name in REASONING_PARSERS:
        return REASONING_PARSERS[name]
    plugins = _plugin_reasoning_parsers()
    if name in plugins:
        return plugins[name][0]
    raise ValueError(f"unknown reasoning parser {name!r}; the parsers are: {', '.join(reasoning_parser_names())}")
