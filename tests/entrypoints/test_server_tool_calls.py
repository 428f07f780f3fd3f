"""Streamed tool calls end to end: a server with --tool-parser-plugin FILE whose parser (the
pythonic format, under the plugin's name) --tool-call-parser selects, through the official
``openai`` client. The tiny random model is made to write the calls (guided_choice)."""
from __future__ import annotations

import json
import textwrap

import httpx
import pytest
from server_utils import SERVED_NAME, ServerProcess, server_args

pytestmark = pytest.mark.slow  # starts a server (inner loop: -m 'not slow')

MESSAGES = [{"role": "user", "content": "weather in Paris, and the time?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
WRITTEN = "[get_weather(city='Paris', unit='F'), get_time(zone='CET')]"
PLUGIN = textwrap.dedent('''
    from halserve.entrypoints.openai.tool_parsers import register_tool_parser
    from halserve.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

    @register_tool_parser("acme_pythonic")
    class AcmePythonic(PythonicToolParser):
        """The pythonic format under a plugin's name."""
''')


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("tool_calls")
    plugin = root / "acme_parsers.py"
    plugin.write_text(PLUGIN)
    args = server_args(checkpoint, "--max-model-len", "256", "--enable-auto-tool-choice",
                       "--tool-parser-plugin", str(plugin), "--tool-call-parser", "acme_pythonic")
    srv = ServerProcess(args, str(root / "server.log")).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_streamed_calls_arrive_name_first_then_argument_deltas(client, server):
    chat = dict(model=SERVED_NAME, messages=MESSAGES, max_completion_tokens=150, tools=[WEATHER, TIME],
                extra_body={"guided_choice": [WRITTEN]})
    whole = client.chat.completions.create(**chat).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [(n, json.loads(a)) for n, a in expected] == [("get_weather", {"city": "Paris", "unit": "F"}),
                                                         ("get_time", {"zone": "CET"})]

    chunks = list(client.chat.completions.create(stream=True, **chat))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    calls: dict[int, dict] = {}
    for chunk in chunks:
        delta = chunk.choices[0].delta
        assert not delta.content
        for piece in delta.tool_calls or []:
            if piece.index not in calls:  # a call's first delta: its id, type and name
                assert piece.id and piece.type == "function" and piece.function.name
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "deltas": []}
            else:
                assert piece.id is None and piece.function.name is None
            if piece.function.arguments:
                calls[piece.index]["deltas"].append(piece.function.arguments)
    assert sorted(calls) == [0, 1] and calls[0]["id"] != calls[1]["id"]
    assert [(c["name"], "".join(c["deltas"])) for c in (calls[0], calls[1])] == expected
    assert len(calls[0]["deltas"]) > 1  # streamed as written, not sent whole

    # on the wire, a later delta carries only its index and the arguments it adds (OpenAI's shape)
    body = {"model": SERVED_NAME, "messages": MESSAGES, "max_completion_tokens": 150, "stream": True,
            "tools": [WEATHER, TIME], "guided_choice": [WRITTEN]}
    raw = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).text
    events = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    later = [tc for e in events for tc in e["choices"][0]["delta"].get("tool_calls") or [] if "id" not in tc]
    assert later and all(set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"} for tc in later)


def test_text_that_is_no_call_streams_as_content(client):
    chat = dict(model=SERVED_NAME, messages=MESSAGES, max_completion_tokens=60, tools=[WEATHER, TIME],
                extra_body={"guided_choice": ["[get_weather('Paris')] is how I would do it"]})
    whole = client.chat.completions.create(**chat).choices[0]
    assert whole.finish_reason == "stop" and not whole.message.tool_calls
    chunks = list(client.chat.completions.create(stream=True, **chat))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
