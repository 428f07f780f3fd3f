"""Tool-call parsers: each format's recorded output parsed whole and streamed in pieces gives the
same calls; streamed arguments arrive in several deltas that concatenate to the final arguments;
malformed calls are text, never an exception; parsers come from plugins and plugin files."""
from __future__ import annotations

import json
import random
import textwrap
import types

import pytest

from halserve.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ScannedCall,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
    load_tool_parser_plugin,
    parse_hermes,
    register_tool_parser,
    tool_parser_names,
)
from halserve.entrypoints.openai.tool_parsers.json_prefix import JsonPrefix
from halserve.entrypoints.openai.tool_parsers.registry import unregister_tool_parser

TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}},
}
CALLS = [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"zone": "Europe/Paris"}')]

# what each format's models write for "weather in Paris for 3 days, and the time there"
RECORDED = {
    "hermes": ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>',
               "Let me check both."),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}', None),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]', None),
    "pythonic": ('[get_weather(city="Paris", days=3), get_time(zone=\'Europe/Paris\')]', None),
    "qwen3_coder": ("I'll look these up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                    "<parameter=zone>\nEurope/Paris\n</parameter>\n</function>\n</tool_call>", "I'll look these up."),
    "deepseek_v3": ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                    'get_time\n```json\n{"zone": "Europe/Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Checking."),
}
# the other layouts some parsers take
VARIANTS = [
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}};'
                    '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}', None),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather{"city": "Paris", "days": 3}[TOOL_CALLS]get_time{"zone": "Europe/Paris"}',
     "Sure."),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]'
                '{"zone": "Europe/Paris"}', None),
    ("pythonic", '<|python_start|>[get_weather(city="Paris", days=3), get_time(zone="Europe/Paris")]<|python_end|>',
     None),
    ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
                    '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "Europe/Paris"}'
                    '<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 3}"}</tool_call>'
               '<tool_call>{"arguments": {"zone": "Europe/Paris"}, "name": "get_time"}</tool_call>', None),
]
# text that is no call in the format: parsed and streamed, it is content
MALFORMED = [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": 5}</tool_call>'),
    ("hermes", "<tool_call>not json</tool_call> and then some"),
    ("hermes", '<tool_call>{"name": "book_flight", "arguments": {}}</tool_call>'),  # not one of the tools
    ("hermes", '<tool_call>{"name": "get_weather", "argu'),  # cut short before the arguments
    ("llama3_json", '{"name": get_weather}'),
    ("llama3_json", 'The JSON is {"a": 1}'),
    ("llama3_json", '{"name": "book_flight", "parameters": {}}'),
    ("mistral", "[TOOL_CALLS] sorry, no"),
    ("mistral", '[TOOL_CALLS][{"name": 1, "arguments": {}}]'),
    ("pythonic", '[get_weather("Paris")]'),
    ("pythonic", 'I would call [get_weather(city="Paris")]'),
    ("pythonic", "[1, 2]"),
    ("qwen3_coder", "<tool_call>\n<function=book_flight>\n</function>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\nhello\n</tool_call>"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```python\nx\n```"
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
]


def stream(parser: ToolParser, text: str, pieces: list[int]) -> tuple[str, list[dict]]:
    """Feed ``text`` in pieces of the given sizes; the content and per call its id, name and
    argument deltas."""
    content, calls, end = "", [], 0
    for size in pieces:
        end = min(len(text), end + size)
        delta = parser.stream(text[:end], final=end == len(text))
        content += delta.content
        for piece in delta.calls:
            if piece.index == len(calls):
                assert piece.id and piece.name, "a call's first delta has its id and name"
                calls.append({"id": piece.id, "name": piece.name, "deltas": []})
            else:
                assert piece.index < len(calls) and piece.id is None and piece.name is None
            if piece.arguments:
                calls[piece.index]["deltas"].append(piece.arguments)
        if end == len(text):
            break
    return content, calls


def char_by_char(text: str) -> list[int]:
    return [1] * len(text)


def random_pieces(text: str, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 9) for _ in range(len(text))]


def test_every_format_is_registered():
    assert set(RECORDED) <= set(tool_parser_names())
    for name in RECORDED:
        assert get_tool_parser(name).name == name


@pytest.mark.parametrize("name, text, content", [(n, *RECORDED[n]) for n in RECORDED] + VARIANTS)
def test_recorded_output_parsed_and_streamed(name, text, content):
    cls = get_tool_parser(name)
    assert cls(TOOLS).parse(text) == (content, CALLS)
    for pieces in (char_by_char(text), random_pieces(text, 0), random_pieces(text, 1), [len(text)]):
        streamed_content, calls = stream(cls(TOOLS), text, pieces)
        assert streamed_content == (content or "")
        assert [(c["name"], "".join(c["deltas"])) for c in calls] == CALLS
        assert len({c["id"] for c in calls}) == 2
        if pieces[0] == 1 and '"arguments": "' not in text:  # (arguments in a JSON string go whole)
            # token by token: the arguments arrive as they are written
            assert all(len(c["deltas"]) > 1 for c in calls), calls


@pytest.mark.parametrize("name, text", MALFORMED)
def test_malformed_calls_are_text(name, text):
    cls = get_tool_parser(name)
    assert cls(TOOLS).parse(text) == (text, [])
    for pieces in (char_by_char(text), [len(text)]):
        assert stream(cls(TOOLS), text, pieces) == (text, [])


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_parallel_tool_calls_false_keeps_the_first_call(name):
    text, _ = RECORDED[name]
    content, calls = get_tool_parser(name)(TOOLS, max_calls=1).parse(text)
    assert calls == CALLS[:1]
    _, streamed = stream(get_tool_parser(name)(TOOLS, max_calls=1), text, char_by_char(text))
    assert [(c["name"], "".join(c["deltas"])) for c in streamed] == CALLS[:1]


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_plain_text_streams_as_it_comes(name):
    text = "Paris is sunny today; no tool needed."
    parser = get_tool_parser(name)(TOOLS)
    sent = [parser.stream(text[:n], final=n == len(text)).content for n in range(1, len(text) + 1)]
    assert "".join(sent) == text and parser.num_streamed_calls == 0
    assert sum(1 for s in sent if s) > len(text) // 2  # not held back to the end


def test_call_broken_after_its_arguments_began():
    """Parsed whole, a call whose JSON breaks is text; streamed, its deltas are out: the call
    stays with what was sent, and nothing raises."""
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": NaN}}</tool_call>'
    parser = get_tool_parser("hermes")(TOOLS)
    assert parser.parse(text) == (text, [])
    content, calls = stream(get_tool_parser("hermes")(TOOLS), text, char_by_char(text))
    assert [(c["name"], "".join(c["deltas"])) for c in calls] == [("get_weather", '{"city": ')]
    # cut by max_tokens mid-arguments: streamed, the partial arguments (as OpenAI sends them)
    cut = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    assert get_tool_parser("hermes")(TOOLS).parse(cut) == (cut, [])
    _, calls = stream(get_tool_parser("hermes")(TOOLS), cut, char_by_char(cut))
    assert "".join(calls[0]["deltas"]) == '{"city": "Par'


def test_qwen3_coder_types_values_by_the_schema():
    schema = {"f": {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"}, "tags": {"type": "array"},
        "s": {"type": "string"}, "o": {"type": "object"}}}}
    text = ("<tool_call>\n<function=f>\n<parameter=n>\n7\n</parameter>\n<parameter=x>\n2.5\n</parameter>\n"
            "<parameter=ok>\nTrue\n</parameter>\n<parameter=tags>\n['a', \"b\"]\n</parameter>\n"
            "<parameter=s>\n42\nlines \"quoted\"\n</parameter>\n<parameter=o>\nnull\n</parameter>\n"
            "<parameter=free>\n{\"k\": [1]}\n</parameter>\n</function>\n</tool_call>")
    content, ((name, arguments),) = get_tool_parser("qwen3_coder")(schema).parse(text)
    assert content is None and name == "f"
    assert json.loads(arguments) == {"n": 7, "x": 2.5, "ok": True, "tags": ["a", "b"], "s": '42\nlines "quoted"',
                                     "o": None, "free": {"k": [1]}}
    _, calls = stream(get_tool_parser("qwen3_coder")(schema), text, char_by_char(text))
    assert "".join(calls[0]["deltas"]) == arguments
    # a string value streams as it is written, not once whole
    assert "q" in calls[0]["deltas"] and '\\"' in calls[0]["deltas"]


def test_mistral_ids_and_special_tokens():
    parser = get_tool_parser("mistral")(TOOLS)
    assert get_tool_parser("mistral").needs_special_tokens and not get_tool_parser("hermes").needs_special_tokens
    text = RECORDED["mistral"][0]
    _, calls = stream(parser, text, char_by_char(text))
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)


@pytest.mark.parametrize("value", [
    {"a": 1, "b": [True, None, -2.5, {"c": "d"}], "e": {}, "f": []},
    {"quote": 'say "hi"\n\ttab \\ slash / é 😀 \u0001'},
    {"nested": [[[]], [{}], "x" * 50]},
])
def test_json_prefix_is_json_dumps_and_only_grows(value):
    written = json.dumps(value, indent=1, ensure_ascii=True)  # the model's spacing and escapes
    outputs = []
    lexer = JsonPrefix()
    for n in range(1, len(written) + 1):
        lexer.feed(written[:n])
        outputs.append(lexer.output)
        assert not lexer.error
    assert lexer.end == len(written)
    assert outputs[-1] == json.dumps(value, ensure_ascii=False)
    assert all(b.startswith(a) for a, b in zip(outputs, outputs[1:]))


@pytest.mark.parametrize("text", ['{"a": NaN}', '{"a": 1,}', "{'a': 1}", '{"a": "\x01"}', '{"a" 1}', "[1 2]",
                                  '{"a": tru}', '{"a": 01}'])
def test_json_prefix_refuses_what_is_not_json(text):
    assert JsonPrefix().feed(text).error


def test_backward_compatible_names():
    assert TOOL_PARSERS["hermes"]('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', {"f"}, None) == (
        None, [("f", '{"x": 1}')])
    assert parse_hermes("just text") == ("just text", [])
    assert "hermes" in TOOL_PARSERS and "nope" not in TOOL_PARSERS
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'; the parsers are: deepseek_v3, hermes"):
        get_tool_parser("nope")


class BracketParser(ToolParser):
    """A toy format for the registration tests: ``CALL name {json}`` lines."""

    name = "toy_bracket"

    def scan(self, text: str, final: bool) -> list[str | ScannedCall]:
        if not text.startswith("CALL "):
            return [text] if final or not "CALL ".startswith(text) else []
        name, _, args = text[5:].partition(" ")
        if not _ or not self.accepts(name, 0):
            return [] if not final else [text]
        return [ScannedCall(name, args, final, text)]


def test_register_tool_parser_and_taken_names():
    register_tool_parser(BracketParser)
    try:
        assert "toy_bracket" in tool_parser_names()
        assert get_tool_parser("toy_bracket").parse_text('CALL f {"a": 1}') == (None, [("f", '{"a": 1}')])
        with pytest.raises(ValueError, match="'hermes' .* is already registered by halserve"):
            register_tool_parser("hermes")(type("Mine", (BracketParser,), {}))
        with pytest.raises(TypeError, match="not a subclass of"):
            register_tool_parser(dict)  # type: ignore[arg-type]
    finally:
        unregister_tool_parser("toy_bracket")


def test_tool_parser_plugin_file(tmp_path):
    plugin = tmp_path / "my_parsers.py"
    plugin.write_text(textwrap.dedent('''
        from halserve.entrypoints.openai.tool_parsers import ScannedCall, ToolParser, register_tool_parser

        @register_tool_parser("file_format")
        class FileFormat(ToolParser):
            def scan(self, text, final):
                name, sep, args = text.partition("=>")
                if not sep:
                    return [text] if final else []
                return [ScannedCall(name.strip(), args.strip(), final, text)]
    '''))
    try:
        assert load_tool_parser_plugin(str(plugin)) == ["file_format"]
        assert load_tool_parser_plugin(str(plugin)) == ["file_format"]  # (once per process)
        assert get_tool_parser("file_format").parse_text('f => {"a": 2}') == (None, [("f", '{"a": 2}')])
    finally:
        unregister_tool_parser("file_format")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="broken.py: RuntimeError: boom"):
        load_tool_parser_plugin(str(broken))
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ValueError, match="registered no tool parser"):
        load_tool_parser_plugin(str(empty))


def _load_plugin(monkeypatch, **hooks):
    from halserve.plugins import PluginManager, PluginManifest, PluginRecord, hookimpl
    from halserve.plugins import manager as manager_module

    module = types.ModuleType("halserve_parsers_test_plugin")
    module.halserve_manifest = hookimpl(lambda: PluginManifest(name="parsers", version="0.1", api=">=1,<3"))
    for hook, fn in hooks.items():
        setattr(module, hook, hookimpl(fn))
    mgr = PluginManager()
    record = PluginRecord(name="parsers", target=module.__name__, distribution=None)
    mgr.records.append(record)  # (as discovery does)
    mgr.load_plugin("parsers", module, record)
    monkeypatch.setattr(manager_module, "_manager", mgr)
    return record


def test_plugin_hook_adds_tool_and_reasoning_parsers(monkeypatch):
    from halserve.entrypoints.openai.reasoning import ReplyStart, ThinkTagParser, get_reasoning_parser

    reasoner = ThinkTagParser(ReplyStart.MAYBE, "<reason>", "</reason>")
    record = _load_plugin(monkeypatch, halserve_tool_parsers=lambda: [BracketParser],
                          halserve_reasoning_parsers=lambda: {"reason_tags": reasoner})
    assert record.status == "loaded", record.error
    assert "toy_bracket" in tool_parser_names() and get_tool_parser("toy_bracket") is BracketParser
    assert get_reasoning_parser("reason_tags") is reasoner
    with pytest.raises(ValueError, match="unknown reasoning parser 'x'; the parsers are: deepseek_r1, qwen3, "
                                         "reason_tags"):
        get_reasoning_parser("x")


def test_plugin_with_a_bad_parser_is_named(monkeypatch):
    _load_plugin(monkeypatch, halserve_tool_parsers=lambda: [dict])
    with pytest.raises(TypeError, match="plugin 'parsers': .* is not a subclass of"):
        get_tool_parser("toy_bracket")
    # a misspelt hook refuses the whole plugin, naming the hook it meant
    record = _load_plugin(monkeypatch, halserve_tool_parser=lambda: [BracketParser])
    assert record.status == "failed" and "did you mean halserve_tool_parsers?" in record.error


def kinds(items) -> list:
    """A reply's order: 'text' for each run of text that is not just whitespace, a call's index."""
    out: list = []
    for item in items:
        kind = "text" if isinstance(item, str) else item.index if isinstance(item, ToolCallDelta) else None
        if kind == "text" and (not item.strip() or out[-1:] == ["text"]):
            continue
        if kind is None:  # (parse_items: a call, numbered in order)
            kind = sum(1 for k in out if k != "text")
        if kind == "text" or kind not in out:
            out.append(kind)
    return out


@pytest.mark.parametrize("name, text", [(n, RECORDED[n][0]) for n in RECORDED] + [
    ("hermes", RECORDED["hermes"][0].replace("</tool_call>\n<tool_call>", "</tool_call>\nand then\n<tool_call>")),
])
def test_stream_pieces_keep_the_order_written(name, text):
    """stream_pieces is stream's delta in the reply's order (text around and between the calls),
    the order parse_items gives; joined, it is stream's delta."""
    cls = get_tool_parser(name)
    whole = cls(TOOLS).parse_items(text)
    for pieces in (char_by_char(text), random_pieces(text, 2), [len(text)]):
        parser, twin, streamed, end = cls(TOOLS), cls(TOOLS), [], 0
        for size in pieces:
            end = min(len(text), end + size)
            got = parser.stream_pieces(text[:end], final=end == len(text))
            delta = twin.stream(text[:end], final=end == len(text))
            assert "".join(p for p in got if isinstance(p, str)) == delta.content
            assert [(c.index, c.name, c.arguments) for c in got if not isinstance(c, str)] == [
                (c.index, c.name, c.arguments) for c in delta.calls]
            streamed += got
            if end == len(text):
                break
        assert kinds(streamed) == kinds(whole)
    assert [item for item in whole if isinstance(item, tuple)] == cls(TOOLS).parse(text)[1]
