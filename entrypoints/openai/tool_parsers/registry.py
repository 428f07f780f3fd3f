"""Which tool-call parser a name means: the built-in formats, those plugins contribute
(``halserve_tool_parsers``) and those a ``--tool-parser-plugin FILE`` registers."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, overload

from halserve.entrypoints.openai.tool_parsers.base import ParsedCalls, ToolParser

_PACKAGE = "halserve.entrypoints.openai.tool_parsers"
# name -> "module:Class" (imported when first asked for)
BUILTIN_TOOL_PARSERS: dict[str, str] = {
    "deepseek_v3": f"{_PACKAGE}.deepseek_v3:DeepSeekV3ToolParser",
    "hermes": f"{_PACKAGE}.hermes:HermesToolParser",
    "llama3_json": f"{_PACKAGE}.llama3_json:Llama3JsonToolParser",
    "mistral": f"{_PACKAGE}.mistral:MistralToolParser",
    "pythonic": f"{_PACKAGE}.pythonic:PythonicToolParser",
    "qwen3_coder": f"{_PACKAGE}.qwen3_coder:Qwen3CoderToolParser",
}
_registered: dict[str, tuple[type[ToolParser], str]] = {}  # name -> (class, who registered it)
_loaded_files: dict[str, list[str]] = {}  # --tool-parser-plugin files loaded: real path -> names they added


def check_tool_parser_class(obj: Any, source: str) -> type[ToolParser]:
    """``obj`` if it is a usable parser class, else ``TypeError`` saying what is wrong."""
    if not (isinstance(obj, type) and issubclass(obj, ToolParser)):
        raise TypeError(f"{source}: {obj!r} is not a subclass of "
                        "halserve.entrypoints.openai.tool_parsers.ToolParser")
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{source}: tool parser class {obj.__name__} needs a class attribute name = '...' "
                        "(what --tool-call-parser takes)")
    if obj.scan is ToolParser.scan:
        raise TypeError(f"{source}: tool parser class {obj.__name__} does not implement scan(text, final)")
    return obj


@overload
def register_tool_parser(cls: type[ToolParser], /) -> type[ToolParser]: ...
@overload
def register_tool_parser(name: str, /) -> Callable[[type[ToolParser]], type[ToolParser]]: ...
def register_tool_parser(arg: Any, /) -> Any:
    """Register a parser class under its ``name`` (or the name given): ``@register_tool_parser``
    or ``@register_tool_parser("my_format")`` in a ``--tool-parser-plugin`` file. A name that
    is taken is an error naming who has it."""
    def add(cls: type[ToolParser], name: str | None = None) -> type[ToolParser]:
        if name is not None:
            cls.name = name
        check_tool_parser_class(cls, "register_tool_parser")
        source = getattr(sys.modules.get(cls.__module__), "__file__", None) or cls.__module__
        taken = _owner(cls.name)
        if taken is not None and _registered.get(cls.name, (None,))[0] is not cls:
            raise ValueError(f"tool parser {cls.name!r} ({source}) is already registered by {taken}; "
                             "pick another name")
        _registered[cls.name] = (cls, source)
        return cls

    if isinstance(arg, str):
        return lambda cls: add(cls, arg)
    return add(arg)


def _plugin_parsers() -> dict[str, tuple[type[ToolParser], str]]:
    """The parsers of loaded plugins (their ``halserve_tool_parsers``), checked."""
    from halserve.plugins import get_plugin_manager

    manager = get_plugin_manager()
    found: dict[str, tuple[type[ToolParser], str]] = {}
    for record in manager.records:
        if record.status != "loaded" or not manager.implements(record.name, "halserve_tool_parsers"):
            continue
        for result in manager.call_plugin_hook(record.name, "halserve_tool_parsers"):
            if not isinstance(result, (list, tuple)):
                raise TypeError(f"halserve_tool_parsers of plugin {record.name!r} must return a list of "
                                f"ToolParser classes, got {type(result).__name__}")
            for cls in result:
                check_tool_parser_class(cls, f"plugin {record.name!r}")
                found[cls.name] = (cls, f"plugin {record.name!r}")
    return found


def _owner(name: str) -> str | None:
    if name in BUILTIN_TOOL_PARSERS:
        return "halserve (built-in)"
    if name in _registered:
        return _registered[name][1]
    return None


def tool_parser_names() -> list[str]:
    """Every name ``--tool-call-parser`` takes, sorted."""
    return sorted({*BUILTIN_TOOL_PARSERS, *_registered, *_safe_plugin_parsers()})


def _safe_plugin_parsers() -> dict[str, tuple[type[ToolParser], str]]:
    try:
        return _plugin_parsers()
    except TypeError:
        return {}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class ``name`` means; ``ValueError`` listing the names when there is none."""
    if name in BUILTIN_TOOL_PARSERS:
        module, attr = BUILTIN_TOOL_PARSERS[name].split(":")
        return getattr(importlib.import_module(module), attr)
    if name in _registered:
        return _registered[name][0]
    plugins = _plugin_parsers()
    if name in plugins:
        return plugins[name][0]
    raise ValueError(f"unknown tool-call parser {name!r}; the parsers are: {', '.join(tool_parser_names())} "
                     "(a plugin or --tool-parser-plugin FILE can add more)")


def load_tool_parser_plugin(path: str) -> list[str]:
    """Import the Python file ``path`` (vLLM's ``--tool-parser-plugin``): its
    ``@register_tool_parser`` classes, and those its ``halserve_tool_parsers()`` returns, are
    registered. The names it added; ``ValueError`` saying what went wrong."""
    if not os.path.isfile(path):
        raise ValueError(f"--tool-parser-plugin {path}: no such file")
    key = os.path.realpath(path)
    if key in _loaded_files:  # (loading a file twice would register its classes twice)
        return _loaded_files[key]
    before = set(_registered)
    module_name = f"halserve_tool_parser_plugin_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--tool-parser-plugin {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
        hook = getattr(module, "halserve_tool_parsers", None)
        for cls in (hook() or []) if callable(hook) else []:
            register_tool_parser(cls)
    except Exception as exc:  # noqa: BLE001 - the file's own error, reported in one line
        sys.modules.pop(module_name, None)
        raise ValueError(f"--tool-parser-plugin {path}: {type(exc).__name__}: {exc}") from None
    added = sorted(set(_registered) - before)
    if not added:
        raise ValueError(f"--tool-parser-plugin {path} registered no tool parser; decorate a ToolParser "
                         "subclass with @halserve.entrypoints.openai.tool_parsers.register_tool_parser")
    _loaded_files[key] = added
    return added


def unregister_tool_parser(name: str) -> None:
    """Forget a registered parser (tests)."""
    _registered.pop(name, None)


class _ParseFunctions(Mapping[str, Callable[..., ParsedCalls]]):
    """``TOOL_PARSERS[name](text, tool_names, max_calls)``: the whole-reply parse of each parser
    (the interface from before parsers were classes)."""

    def __getitem__(self, name: str) -> Callable[..., ParsedCalls]:
        try:
            return get_tool_parser(name).parse_text
        except ValueError:
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(tool_parser_names())

    def __len__(self) -> int:
        return len(tool_parser_names())


TOOL_PARSERS: Mapping[str, Callable[..., ParsedCalls]] = _ParseFunctions()


def parse_hermes(text: str, tool_names: Collection[str] | None = None, max_calls: int | None = None) -> ParsedCalls:
    """Hermes / Qwen2.5 / Qwen3 format (``hermes.HermesToolParser``)."""
    return get_tool_parser("hermes").parse_text(text, tool_names, max_calls)
