"""Tool-call parsers for ``tool_choice="auto"``: they find the calls a model wrote in its own
format in the generated text (``halserve serve --enable-auto-tool-choice --tool-call-parser
NAME``, vLLM's flags). Forced calls (``"required"`` or a named function) need no parser: they
are generated to the tools' JSON schema (``constraints``).

One module per format, each a ``ToolParser`` subclass (``base``); ``registry`` maps the names
``--tool-call-parser`` takes to them, including those of plugins (``halserve_tool_parsers``)
and of ``--tool-parser-plugin FILE``."""
from halserve.entrypoints.openai.tool_parsers.base import (
    ParsedCalls,
    ScannedCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamDelta,
)
from halserve.entrypoints.openai.tool_parsers.registry import (
    TOOL_PARSERS,
    get_tool_parser,
    load_tool_parser_plugin,
    parse_hermes,
    register_tool_parser,
    tool_parser_names,
)

__all__ = [
    "TOOL_PARSERS",
    "ParsedCalls",
    "ScannedCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStreamDelta",
    "get_tool_parser",
    "load_tool_parser_plugin",
    "parse_hermes",
    "register_tool_parser",
    "tool_parser_names",
]
