"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official
``anthropic`` client and raw HTTP, on the tiny test server (hermes tool parser), a keyed server
and a thinking server (reasoning parser)."""
from __future__ import annotations

import json

import httpx
import pytest
from server_utils import SERVED_NAME, ServerProcess, server_args

anthropic = pytest.importorskip("anthropic", reason="the Messages API tests use the anthropic client (in dev)")

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

SYSTEM = "be brief"
MESSAGES = [{"role": "user", "content": "tell me about paris"}]
CHAT_MESSAGES = [{"role": "system", "content": SYSTEM}, *MESSAGES]  # the same conversation in OpenAI's shape
WEATHER = {"name": "get_weather", "description": "the weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "input_schema": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}
WRITTEN_CALL = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "C"}}'
                '\n</tool_call>')


@pytest.fixture(scope="module")
def aclient(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def openai_tools(*tools: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}} for t in tools]


def tokenize_count(server, messages: list[dict], **extra) -> int:
    r = httpx.post(server.url + "/tokenize", json={"model": SERVED_NAME, "messages": messages, **extra})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def sse_events(server, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """The raw stream: (event name, data) pairs; each data's type is its event's name."""
    r = httpx.post(server.url + "/v1/messages", json={**body, "stream": True}, headers=headers, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = []
    for chunk in r.text.split("\n\n"):
        if not chunk.strip():
            continue
        name_line, data_line = chunk.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), chunk
        name, data = name_line[7:], json.loads(data_line[6:])
        assert data["type"] == name
        events.append((name, data))
    return events


def test_text_reply_streamed_and_not(aclient, server):
    kwargs = dict(model=SERVED_NAME, system=SYSTEM, messages=MESSAGES, max_tokens=10,
                  extra_body={"temperature": 0, "ignore_eos": True})
    full = aclient.messages.create(**kwargs)
    assert full.type == "message" and full.role == "assistant" and full.model == SERVED_NAME
    assert full.id.startswith("msg_")
    (block,) = full.content
    assert block.type == "text" and block.text
    assert full.stop_reason == "max_tokens" and full.stop_sequence is None
    assert full.usage.output_tokens == 10
    assert full.usage.input_tokens == tokenize_count(server, CHAT_MESSAGES)
    # the system prompt as text blocks is the same prompt
    blocks = aclient.messages.create(**kwargs | {"system": [{"type": "text", "text": SYSTEM}]})
    assert blocks.content[0].text == block.text and blocks.usage.input_tokens == full.usage.input_tokens

    with aclient.messages.stream(**kwargs) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == block.text and final.content[0].text == block.text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10
    assert final.usage.input_tokens == full.usage.input_tokens

    # Anthropic's exact event sequence
    body = dict(model=SERVED_NAME, system=SYSTEM, messages=MESSAGES, max_tokens=10, temperature=0, ignore_eos=True)
    events = sse_events(server, body)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert start["usage"]["input_tokens"] == full.usage.input_tokens
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    assert "".join(d["text"] for d in deltas) == block.text
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 10


def test_sampling_fields(aclient):
    """temperature, top_p and top_k (Anthropic's fields; this client version sends them as extra_body)."""
    def reply(**sampling) -> str:
        out = aclient.messages.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=8, metadata={"user_id": "u1"},
                                      extra_body={"ignore_eos": True, **sampling})
        return out.content[0].text

    assert reply(temperature=1.0, top_p=0.9, top_k=20, seed=7) == reply(temperature=1.0, top_p=0.9, top_k=20, seed=7)
    greedy = reply(temperature=0)
    assert reply(temperature=1.0, top_k=1, seed=1) == greedy == reply(temperature=1.0, top_p=1e-6, seed=2)
    assert {reply(temperature=2.0, seed=seed) for seed in range(3)} != {greedy}  # (sampling does sample)


def test_stop_sequences(aclient):
    kwargs = dict(model=SERVED_NAME, messages=MESSAGES, max_tokens=16, extra_body={"temperature": 0, "ignore_eos": True})
    text = aclient.messages.create(**kwargs).content[0].text
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip())
    cut = text[: text.find(stop)]
    out = aclient.messages.create(stop_sequences=[stop, "never-generated"], **kwargs)
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert "".join(b.text for b in out.content) == cut
    with aclient.messages.stream(stop_sequences=[stop], **kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert "".join(b.text for b in final.content) == cut


def test_tool_use_and_its_result(aclient, server):
    """tool_choice auto: the model's hermes call (made deterministic with guided_choice) becomes a
    tool_use block; the call and its tool_result go back as the next turn."""
    kwargs = dict(model=SERVED_NAME, system=SYSTEM, messages=MESSAGES, max_tokens=100, tools=[WEATHER, TIME],
                  extra_body={"guided_choice": [WRITTEN_CALL]})
    out = aclient.messages.create(**kwargs)
    assert [b.type for b in out.content] == ["text", "tool_use"]
    text, call = out.content
    assert text.text == "Let me check."
    assert call.name == "get_weather" and call.input == {"city": "Lyon", "unit": "C"} and call.id.startswith("toolu_")
    assert out.stop_reason == "tool_use"

    # streamed: the same message (but for the ids, and the output's token count: the model may write the
    # text in other tokens), the text and the call's input as they are written
    with aclient.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    ignored = {"id": True, "content": {1: {"id"}}, "usage": {"output_tokens"}}
    assert final.model_dump(exclude=ignored) == out.model_dump(exclude=ignored)
    assert final.content[1].id.startswith("toolu_")
    body = dict(model=SERVED_NAME, system=SYSTEM, messages=MESSAGES, max_tokens=100, tools=[WEATHER, TIME],
                guided_choice=[WRITTEN_CALL])
    events = sse_events(server, body)
    starts = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert starts[0] == {"type": "text", "text": ""}
    assert starts[1]["type"] == "tool_use" and starts[1]["name"] == "get_weather" and starts[1]["input"] == {}
    text_deltas = [data["delta"]["text"] for name, data in events if name == "content_block_delta" and data["index"] == 0]
    json_deltas = [data["delta"]["partial_json"] for name, data in events
                   if name == "content_block_delta" and data["index"] == 1]
    assert "".join(text_deltas) == "Let me check." and len(text_deltas) > 1
    assert "".join(json_deltas) == json.dumps(call.input) and len(json_deltas) > 1
    assert [name for name, _ in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    # a malformed call (not one of the tools) is text, streamed and not
    booking = 'Booking.\n<tool_call>\n{"name": "book_flight", "arguments": {}}\n</tool_call>'
    malformed = aclient.messages.create(**kwargs | {"extra_body": {"guided_choice": [booking]}})
    with aclient.messages.stream(**kwargs | {"extra_body": {"guided_choice": [booking]}}) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.text) for b in malformed.content] == [(b.type, b.text) for b in streamed.content] == [
        ("text", booking)]
    assert malformed.stop_reason == streamed.stop_reason == "end_turn"

    # no call written: a plain text reply
    plain = aclient.messages.create(**kwargs | {"extra_body": {"guided_choice": ["no tools needed"]}})
    assert [b.type for b in plain.content] == ["text"] and plain.stop_reason == "end_turn"

    # the second turn: the assistant's tool_use and the user's tool_result
    history = [*MESSAGES, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "18 degrees"}]}]}]
    follow_up = aclient.messages.create(model=SERVED_NAME, system=SYSTEM, messages=history, max_tokens=3,
                                        tools=[WEATHER, TIME], extra_body={"ignore_eos": True})
    assert follow_up.content[0].type == "text" and follow_up.usage.output_tokens == 3
    chat_history = [*CHAT_MESSAGES,
                    {"role": "assistant", "content": "Let me check.", "tool_calls": [
                        {"id": call.id, "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps(call.input)}}]},
                    {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}]
    expected = tokenize_count(server, chat_history, tools=openai_tools(WEATHER, TIME))
    assert follow_up.usage.input_tokens == expected
    counted = aclient.messages.count_tokens(model=SERVED_NAME, system=SYSTEM, messages=history, tools=[WEATHER, TIME])
    assert counted.input_tokens == expected
    # (the tool result reaches the prompt: a different result, a different prompt)
    other = json.loads(json.dumps(history).replace("18 degrees", "a much longer tool result than before"))
    assert aclient.messages.count_tokens(model=SERVED_NAME, system=SYSTEM, messages=other,
                                         tools=[WEATHER, TIME]).input_tokens > expected


def test_forced_tool_choice(aclient):
    kwargs = dict(model=SERVED_NAME, messages=MESSAGES, max_tokens=116, tools=[WEATHER, TIME])  # (128 - the 12-token prompt)
    named = aclient.messages.create(tool_choice={"type": "tool", "name": "get_time"}, extra_body={"seed": 1},
                                    **kwargs)
    (call,) = named.content
    assert call.type == "tool_use" and call.name == "get_time" and call.input["zone"] in ("UTC", "CET")
    assert named.stop_reason == "tool_use"
    with aclient.messages.stream(tool_choice={"type": "tool", "name": "get_time"}, extra_body={"seed": 1},
                                 **kwargs) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content] == [(call.name, call.input)]  # (the same seed)
    names = set()
    for seed in range(4):
        out = aclient.messages.create(tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                      extra_body={"seed": seed}, **kwargs)
        (call,) = out.content
        assert out.stop_reason == "tool_use" and call.type == "tool_use"
        assert (call.name, set(call.input)) in (("get_weather", {"city", "unit"}), ("get_time", {"zone"}))
        names.add(call.name)
    assert names == {"get_weather", "get_time"}
    # none: the model writes text, and a call it writes is not parsed
    none = aclient.messages.create(tool_choice={"type": "none"}, extra_body={"guided_choice": [WRITTEN_CALL]},
                                   **kwargs)
    assert [b.type for b in none.content] == ["text"] and none.content[0].text == WRITTEN_CALL


def test_count_tokens_is_the_engines_prompt(aclient, server):
    counted = aclient.messages.count_tokens(model=SERVED_NAME, system=SYSTEM, messages=MESSAGES)
    assert counted.input_tokens == tokenize_count(server, CHAT_MESSAGES)
    used = aclient.messages.create(model=SERVED_NAME, system=SYSTEM, messages=MESSAGES, max_tokens=1)
    assert used.usage.input_tokens == counted.input_tokens
    with_tools = aclient.messages.count_tokens(model=SERVED_NAME, system=SYSTEM, messages=MESSAGES, tools=[WEATHER])
    assert with_tools.input_tokens == tokenize_count(server, CHAT_MESSAGES, tools=openai_tools(WEATHER))


def error_of(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


def test_errors_are_anthropic_shaped(aclient, server):
    url = server.url + "/v1/messages"
    base = {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 4}
    message = error_of(httpx.post(url, json={"model": SERVED_NAME, "messages": MESSAGES}), 400, "invalid_request_error")
    assert "max_tokens is required" in message
    assert "max_tokens" in error_of(httpx.post(url, json=base | {"max_tokens": 0}), 400, "invalid_request_error")
    message = error_of(httpx.post(url, json=base | {"messages": [{"role": "system", "content": "x"}]}), 400,
                       "invalid_request_error")
    assert "messages[0].role" in message and "'user' or 'assistant'" in message and '"system"' in message
    with pytest.raises(anthropic.BadRequestError) as caught:
        aclient.messages.create(model=SERVED_NAME, max_tokens=4, messages=[{"role": "tool", "content": "x"}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        aclient.messages.create(model="claude-nope", max_tokens=4, messages=MESSAGES)
    # a text-only model: an image block is a 400 that says where it is
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    message = error_of(httpx.post(url, json=base | {"messages": [{"role": "user", "content": [image]}]}), 400,
                       "invalid_request_error")
    assert "messages[0].content[0]" in message and "text only" in message
    # no reasoning parser: thinking is a 400 that says how to start the server
    message = error_of(httpx.post(url, json=base | {"thinking": {"type": "enabled", "budget_tokens": 1024}}), 400,
                       "invalid_request_error")
    assert "--reasoning-parser" in message
    assert httpx.post(url, json=base | {"thinking": {"type": "disabled"}}, timeout=60).status_code == 200
    for bad in ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, {"tool_choice": {"type": "any"}},
                {"tools": [{"name": "web_search", "type": "web_search_20250305"}]},
                {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
                {"stop_sequences": [""]}, {"temperature": "hot"}):
        error_of(httpx.post(url, json=base | bad), 400, "invalid_request_error")
    message = error_of(httpx.post(url, content=b"{not json"), 400, "invalid_request_error")
    assert "JSON" in message
    error_of(httpx.post(server.url + "/v1/messages/count_tokens", json={"model": SERVED_NAME, "messages": []}), 400,
             "invalid_request_error")
    # a forced call to a tool whose input_schema is no JSON schema names the tool (it named tool_choice)
    bad_tool = {"name": "bad", "input_schema": {"type": "nosuchtype"}}
    message = error_of(httpx.post(url, json=base | {"tools": [WEATHER, bad_tool], "tool_choice": {"type": "any"}}),
                       400, "invalid_request_error")
    assert message.startswith("tools[1].input_schema (tool 'bad'): invalid JSON schema"), message
    # the server still serves
    assert aclient.messages.create(**base).usage.output_tokens >= 1


@pytest.fixture(scope="module")
def keyed_server(checkpoint, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("anthropic_auth") / "server.log")
    srv = ServerProcess(server_args(checkpoint, "--api-key", "key-one"), log).wait_ready()
    yield srv
    srv.stop()


def test_api_key_as_x_api_key_or_bearer(keyed_server):
    url = keyed_server.url
    body = {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 2}
    for headers in ({}, {"x-api-key": "nope"}, {"Authorization": "Bearer nope"}):
        message = error_of(httpx.post(url + "/v1/messages", json=body, headers=headers), 401, "authentication_error")
        assert "x-api-key" in message
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(**body)
    by_key = anthropic.Anthropic(base_url=url, api_key="key-one", max_retries=0, timeout=60)  # x-api-key
    assert by_key.messages.create(**body).usage.output_tokens >= 1
    assert by_key.messages.count_tokens(model=SERVED_NAME, messages=MESSAGES).input_tokens > 0
    by_token = anthropic.Anthropic(base_url=url, auth_token="key-one", max_retries=0, timeout=60)  # Bearer
    assert by_token.messages.create(**body).usage.output_tokens >= 1
    # x-api-key works on the OpenAI routes too; their 401 stays OpenAI-shaped
    assert httpx.get(url + "/v1/models", headers={"x-api-key": "key-one"}).status_code == 200
    assert httpx.get(url + "/v1/models").json()["error"]["code"] == "invalid_api_key"


def test_output_config_format(aclient):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"],
              "additionalProperties": False}
    out = aclient.messages.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=116, extra_body={"seed": 3},
                                  output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}})
    assert out.stop_reason == "end_turn"
    assert json.loads(out.content[0].text)["city"] in ("Paris", "Lyon")


def test_thinking_blocks(thinking_server):
    """The think block becomes a thinking block ahead of the text, streamed as thinking_delta; the
    same split as /v1/chat/completions' reasoning and content. The random model is nudged to close
    its thinking with logit_bias on </think>."""
    import openai

    url = thinking_server.url
    (end,) = httpx.post(url + "/tokenize", json={"model": SERVED_NAME, "prompt": "</think>",
                                                 "add_special_tokens": False}).json()["tokens"]
    sampling = {"temperature": 1.0, "seed": 3, "logit_bias": {str(end): 4.0}}
    chat = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60).chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=24, extra_body=sampling).choices[0].message.model_dump()
    assert chat["reasoning"] and chat["content"]  # (the nudge works: the test would say nothing otherwise)
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)
    kwargs = dict(model=SERVED_NAME, messages=MESSAGES, max_tokens=24, extra_body=sampling,
                  thinking={"type": "enabled", "budget_tokens": 1024})
    out = client.messages.create(**kwargs)
    assert [b.type for b in out.content] == ["thinking", "text"]
    assert out.content[0].thinking == chat["reasoning"] and out.content[1].text == chat["content"]
    assert client.messages.create(**kwargs | {"thinking": {"type": "adaptive"}}).content == out.content
    events = sse_events(thinking_server, dict(model=SERVED_NAME, messages=MESSAGES, max_tokens=24,
                                              thinking={"type": "enabled", "budget_tokens": 1024}, **sampling))
    starts = [(data["index"], data["content_block"]["type"]) for name, data in events if name == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    deltas = [data for name, data in events if name == "content_block_delta"]
    assert "".join(d["delta"]["thinking"] for d in deltas if d["index"] == 0) == chat["reasoning"]
    assert "".join(d["delta"]["text"] for d in deltas if d["index"] == 1) == chat["content"]
    assert {d["delta"]["type"] for d in deltas if d["index"] == 0} == {"thinking_delta"}
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message().content
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "text", None)) for b in streamed] == [
        ("thinking", out.content[0].thinking, None), ("text", None, out.content[1].text)]
    # disabled: the template closes an empty think block, the reply is all text
    off = client.messages.create(**kwargs | {"thinking": {"type": "disabled"}})
    plain = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=24,
        extra_body={**sampling, "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == plain.content
    # an earlier thinking block reaches the template (as reasoning_content)
    history = [*MESSAGES, {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                                             {"type": "text", "text": "paris is big"}]},
               {"role": "user", "content": "more"}]
    counted = client.messages.count_tokens(model=SERVED_NAME, messages=history).input_tokens
    chat_history = [*MESSAGES, {"role": "assistant", "content": "paris is big", "reasoning_content": "hmm"},
                    {"role": "user", "content": "more"}]
    assert counted == tokenize_count(thinking_server, chat_history)
    assert counted > client.messages.count_tokens(model=SERVED_NAME, messages=history[:1] + [
        {"role": "assistant", "content": "paris is big"}, history[2]]).input_tokens


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory):
    from mm_factory import make_llava_checkpoint

    root = tmp_path_factory.mktemp("anthropic_llava")
    srv = ServerProcess(server_args(make_llava_checkpoint(root / "ckpt")), str(root / "server.log"))
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_image_blocks(llava_server):
    """An image block on a vision-language model: the reply chat gives for the same image_url part,
    and count_tokens counts the image's expanded tokens as the engine does."""
    import openai
    from mm_factory import image_data_url, make_image

    url = image_data_url(make_image(1))
    media_type, data = url[len("data:"):].split(";base64,")
    question = "what is in the picture"
    client = anthropic.Anthropic(base_url=llava_server.url, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}},
        {"type": "text", "text": question}]}]
    out = client.messages.create(model=SERVED_NAME, messages=messages, max_tokens=6,
                                 extra_body={"temperature": 0, "ignore_eos": True})
    chat = openai.OpenAI(base_url=llava_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    expected = chat.chat.completions.create(model=SERVED_NAME, max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": [
                                                {"type": "image_url", "image_url": {"url": url}},
                                                {"type": "text", "text": question}]}])
    assert out.content[0].text == expected.choices[0].message.content
    assert out.usage.input_tokens == expected.usage.prompt_tokens
    counted = client.messages.count_tokens(model=SERVED_NAME, messages=messages).input_tokens
    text_only = client.messages.count_tokens(model=SERVED_NAME, messages=[{"role": "user", "content": question}])
    assert counted == out.usage.input_tokens and counted - text_only.input_tokens >= 16  # (16 image tokens)
    # an image in an assistant turn is refused, saying where
    bad = [messages[0], {"role": "assistant", "content": messages[0]["content"]}, {"role": "user", "content": "?"}]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[1\]\.content\[0\]"):
        client.messages.create(model=SERVED_NAME, messages=bad, max_tokens=2)
