"""POST /v1/responses (OpenAI's Responses API) through the official ``openai`` client: the same
generation as /v1/chat/completions for the same seeded request, its streamed events in the
client's types and order, status incomplete at max_output_tokens, structured outputs through
text.format, reasoning items with --reasoning-parser, and 400s naming what is not supported.

The bodies are also read as raw JSON and validated strictly against the client's pydantic types
(the client itself builds them leniently, so a missing field would go unnoticed there)."""
from __future__ import annotations

import json
import re
import time
from typing import Literal

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter
from server_utils import SERVED_NAME

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

INSTRUCTIONS = "be brief"
QUESTION = "tell me about paris"
CHAT_MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]}, "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
EVENTS = TypeAdapter(ResponseStreamEvent)


def create_raw(server, **body) -> dict:
    """A non-streamed response's JSON, checked against the client's Response type."""
    r = httpx.post(server.url + "/v1/responses", json={"model": SERVED_NAME, **body}, timeout=60)
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())
    return r.json()


def stream_raw(server, **body) -> list[dict]:
    """A streamed response's events (``event:`` name and ``data:`` JSON), each checked against
    the client's event types; the name must match the payload's type."""
    r = httpx.post(server.url + "/v1/responses", json={"model": SERVED_NAME, "stream": True, **body}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = []
    for block in filter(None, r.text.split("\n\n")):
        name_line, data_line = block.split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {payload['type']}"
        EVENTS.validate_python(payload)
        events.append(payload)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def message_events(events: list[dict]) -> tuple[str, dict]:
    """Check the message item's events are in order and agree; return (the concatenated text
    deltas, the completed response)."""
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    start = types.index("response.output_item.added", 2)
    while events[start]["item"]["type"] != "message":
        start = types.index("response.output_item.added", start + 1)
    end = types.index("response.output_item.done", start)
    body = types[start:end + 1]
    n = body.count("response.output_text.delta")
    assert body == (["response.output_item.added", "response.content_part.added"]
                    + ["response.output_text.delta"] * n
                    + ["response.output_text.done", "response.content_part.done", "response.output_item.done"])
    item_id = events[start]["item"]["id"]
    assert all(e.get("item_id", item_id) == item_id for e in events[start:end])
    text = "".join(e["delta"] for e in events[start:end] if e["type"] == "response.output_text.delta")
    assert events[end - 2]["text"] == events[end - 1]["part"]["text"] == text
    assert events[end]["item"]["content"][0]["text"] == text
    completed = events[-1]["response"]
    assert completed["id"] == events[0]["response"]["id"]
    assert [o for o in completed["output"] if o["type"] == "message"] == [events[end]["item"]]
    return text, completed


# ---------------------------------------------------------------------- the main test server
def test_text_equals_chat_for_the_same_seeded_request(server, client):
    """instructions + input render as chat's system + user messages: the same prompt (token
    counts agree with /tokenize), and with the same seed the same text."""
    sampling = dict(temperature=1.0, top_p=0.9)
    chat = client.chat.completions.create(model=SERVED_NAME, messages=CHAT_MESSAGES, max_completion_tokens=12,
                                          extra_body={"seed": 7}, **sampling)
    response = client.responses.create(model=SERVED_NAME, input=QUESTION, instructions=INSTRUCTIONS,
                                       max_output_tokens=12, extra_body={"seed": 7}, **sampling)
    assert response.output_text == chat.choices[0].message.content
    assert re.fullmatch("resp_[0-9a-f]{32}", response.id) and response.object == "response"
    assert response.model == SERVED_NAME and response.instructions == INSTRUCTIONS
    assert response.temperature == 1.0 and response.top_p == 0.9 and response.max_output_tokens == 12
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    expected = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == message.status == expected
    usage = response.usage
    n_prompt = httpx.post(server.url + "/tokenize", json={"messages": CHAT_MESSAGES}).json()["count"]
    assert usage.input_tokens == chat.usage.prompt_tokens == n_prompt
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    # the instructions are in the prompt: without them it is shorter and the text differs
    bare = client.responses.create(model=SERVED_NAME, input=QUESTION, max_output_tokens=12,
                                   extra_body={"seed": 7}, **sampling)
    n_bare = httpx.post(server.url + "/tokenize", json={"messages": CHAT_MESSAGES[1:]}).json()["count"]
    assert bare.usage.input_tokens == n_bare < n_prompt
    # the raw body passes the client's types strictly, settings echoed as they apply
    raw = create_raw(server, input=QUESTION, max_output_tokens=3, metadata={"run": "1"}, user="u", store=True)
    assert raw["metadata"] == {"run": "1"} and raw["user"] == "u" and raw["store"] is False
    assert raw["text"] == {"format": {"type": "text"}} and raw["tools"] == [] and raw["tool_choice"] == "auto"
    assert raw["usage"]["input_tokens_details"]["cached_tokens"] >= 0


def test_message_items_render_like_chat_messages(client):
    """A list input (text parts, an earlier assistant turn, a developer message) gives the chat
    endpoint's text for the same conversation."""
    items = [
        {"role": "developer", "content": "answer in french"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "tell me "},
                                                          {"type": "input_text", "text": "about paris"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "a city", "annotations": []}]},
        {"role": "user", "content": "more"},
    ]
    messages = [{"role": "developer", "content": "answer in french"}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "a city"}, {"role": "user", "content": "more"}]
    chat = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_completion_tokens=10,
                                          temperature=0)
    response = client.responses.create(model=SERVED_NAME, input=items, max_output_tokens=10, temperature=0)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_events_build_the_same_response(server, client):
    body = dict(input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=16, temperature=1.0, seed=11)
    whole = create_raw(server, **body)
    events = stream_raw(server, **body)
    text, completed = message_events(events)
    assert text == whole["output"][0]["content"][0]["text"]
    assert completed["status"] == whole["status"] and completed["usage"] == whole["usage"]
    Response.model_validate(completed)
    # the client's own stream helper accumulates the events into the same final response
    with client.responses.stream(model=SERVED_NAME, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=16,
                                 temperature=1.0, extra_body={"seed": 11}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == text


def test_max_output_tokens_makes_the_response_incomplete(server, client):
    response = client.responses.create(model=SERVED_NAME, input=QUESTION, max_output_tokens=4,
                                       extra_body={"ignore_eos": True})
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 4
    # streamed: the last event is response.completed (as vLLM sends it) with the same status
    events = stream_raw(server, input=QUESTION, max_output_tokens=4, ignore_eos=True)
    _, completed = message_events(events)
    assert completed["status"] == "incomplete" and completed["incomplete_details"] == {"reason": "max_output_tokens"}
    assert completed["usage"]["output_tokens"] == 4


class City(BaseModel):
    city: Literal["Paris", "Lyon", "Nice"]
    population: int = Field(ge=0)


def test_text_format_constrains_the_output(server, client):
    """The tiny model's random weights never write these by chance: the constraint is at work."""
    pytest.importorskip("xgrammar", reason="structured outputs need the structured-outputs extra (in dev)")
    parsed = client.responses.parse(model=SERVED_NAME, input=QUESTION, text_format=City, max_output_tokens=60,
                                    temperature=1.0, extra_body={"seed": 0})
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)
    fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
    raw = create_raw(server, input=QUESTION, text={"format": fmt}, max_output_tokens=60, temperature=1.0, seed=1)
    out = json.loads(raw["output"][0]["content"][0]["text"])
    assert set(out) == {"city", "population"} and out["city"] in ("Paris", "Lyon", "Nice")
    assert isinstance(out["population"], int) and out["population"] >= 0
    assert raw["text"]["format"] == fmt  # (echoed as sent)
    # streamed too
    text, _ = message_events(stream_raw(server, input=QUESTION, text={"format": fmt}, max_output_tokens=60,
                                        temperature=1.0, seed=2))
    assert set(json.loads(text)) == {"city", "population"}
    # json_object: the output opens an object
    anything = client.responses.create(model=SERVED_NAME, input=QUESTION, text={"format": {"type": "json_object"}},
                                       max_output_tokens=20)
    assert anything.output_text.startswith("{")


BAD_REQUESTS = {
    "previous_response_id": ({"previous_response_id": "resp_123"}, "previous_response_id", "does not store"),
    "background": ({"background": True}, "background", "background"),
    "tools": ({"tools": [{"type": "web_search"}]}, "tools", "only function tools are supported"),
    "tool_choice": ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    "image input": ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
                    "input[0].content[0]", "input_image"),
    "file input": ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
                   "input[0].content[0]", "input_file"),
    "function call output": ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
                             "input", "at least one message"),
    "function call": ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c"}]},
                      "input[1]", "needs name, arguments"),
    "no message": ({"input": []}, "input", "at least one message"),
    "max_output_tokens 0": ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    "json_schema without schema": ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format",
                                   "schema"),
    "unknown format": ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "json_schema"),
    "chat's response_format": ({"response_format": {"type": "json_object"}}, "response_format", "text.format"),
    "truncation auto": ({"truncation": "auto"}, "truncation", "disabled"),
    "temperature": ({"temperature": -1}, "temperature", "temperature"),
    "input too long": ({"input": "the " * 300}, "input", "max_model_len"),
    "beam search": ({"use_beam_search": True}, "use_beam_search", "/v1/chat/completions"),
    # (named text.format, which the request did not send)
    "forced call, bad tool schema": ({"tools": [{"type": "function", "name": "bad", "parameters": {"type": "nosuchtype"}}],
                                     "tool_choice": "required"}, "tools[0].parameters", "invalid JSON schema"),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_unsupported_or_bad_fields_are_400s_naming_them(server, client, name):
    fields, param, words = BAD_REQUESTS[name]
    with pytest.raises(openai.BadRequestError) as err:
        # (as extra_body: the fields the client itself does not take reach the server too)
        client.responses.create(model=SERVED_NAME, input=QUESTION, max_output_tokens=4, extra_body=fields)
    assert err.value.status_code == 400 and err.value.body["param"] == param
    assert words in err.value.body["message"], err.value.body
    assert httpx.get(server.url + "/health").status_code == 200


def test_unknown_model_and_stored_responses_are_404s(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="no-such-model", input=QUESTION)
    assert err.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve("resp_123")
    assert "does not store" in err.value.body["message"]


def aborted(server) -> float:
    """Requests ended by an abort so far (the /metrics counter)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    match = re.search(r'^halserve:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_a_client_that_leaves_aborts_its_request(server, client):
    before = aborted(server)
    stream = client.responses.create(model=SERVED_NAME, input=QUESTION, max_output_tokens=100, stream=True,
                                     extra_body={"ignore_eos": True})
    for event in stream:
        if event.type == "response.output_text.delta":
            stream.close()  # the client goes away mid-stream
            break
    deadline = time.monotonic() + 20
    while aborted(server) < before + 1:
        assert time.monotonic() < deadline, "the abandoned stream's request was not aborted"
        time.sleep(0.1)


# ---------------------------------------------------------------------- a thinking model
@pytest.fixture(scope="module")
def thinking_client(thinking_server):
    return openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def end_tag_id(server) -> int:
    body = {"prompt": "</think>", "add_special_tokens": False}
    (tid,) = httpx.post(server.url + "/tokenize", json=body).json()["tokens"]
    return tid


def test_reasoning_goes_to_a_reasoning_item(thinking_server, thinking_client):
    """The reasoning item and the message hold chat's reasoning and content for the same seeded
    request (the random model is nudged to close its thinking with logit_bias on </think>)."""
    end = end_tag_id(thinking_server)
    extra = {"seed": 3, "logit_bias": {str(end): 4.0}}
    messages = [{"role": "user", "content": QUESTION}]
    chat = thinking_client.chat.completions.create(model=SERVED_NAME, messages=messages, max_completion_tokens=24,
                                                   temperature=1.0, extra_body=extra).choices[0]
    chat_message = chat.message.model_dump()
    assert chat_message["reasoning"] and chat_message["content"], chat_message  # (the nudge works)
    raw = create_raw(thinking_server, input=QUESTION, max_output_tokens=24, temperature=1.0, **extra)
    reasoning, message = raw["output"]
    assert reasoning["type"] == "reasoning" and reasoning["status"] == "completed"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": chat_message["reasoning"]}]
    assert message["type"] == "message" and message["content"][0]["text"] == chat_message["content"]
    # reasoning tokens: those up to and including </think>
    completion = thinking_client.completions.create(
        model=SERVED_NAME, max_tokens=24, temperature=1.0, extra_body=extra,
        prompt=httpx.post(thinking_server.url + "/tokenize", json={"messages": messages}).json()["tokens"],
        logprobs=0)
    tokens = completion.choices[0].logprobs.tokens
    assert raw["usage"]["output_tokens_details"]["reasoning_tokens"] == tokens.index("</think>") + 1

    # streamed: a reasoning item (reasoning_text events), closed before the message opens
    events = stream_raw(thinking_server, input=QUESTION, max_output_tokens=24, temperature=1.0, **extra)
    text, completed = message_events(events)
    types = [e["type"] for e in events]
    assert events[2]["type"] == "response.output_item.added" and events[2]["item"]["type"] == "reasoning"
    first_delta = types.index("response.reasoning_text.delta")
    done = types.index("response.reasoning_text.done")
    streamed = "".join(e["delta"] for e in events[first_delta:done])
    assert streamed == events[done]["text"] == chat_message["reasoning"]
    assert types.index("response.output_item.done") < types.index("response.output_text.delta")
    assert text == chat_message["content"]
    assert completed["output"][0]["content"] == reasoning["content"] and completed["usage"] == raw["usage"]

    # the output passed back as input carries the reasoning to the template, as chat's does
    more = {"role": "user", "content": "more"}
    again = thinking_client.responses.create(model=SERVED_NAME, input=[{"role": "user", "content": QUESTION},
                                                                       *raw["output"], more], max_output_tokens=2)
    conversation = messages + [{"role": "assistant", "content": chat_message["content"],
                                "reasoning": chat_message["reasoning"]}, more]
    n_prompt = httpx.post(thinking_server.url + "/tokenize", json={"messages": conversation}).json()["count"]
    assert again.usage.input_tokens == n_prompt


def test_text_format_applies_after_the_thinking(thinking_server, thinking_client):
    pytest.importorskip("xgrammar", reason="structured outputs need the structured-outputs extra (in dev)")
    end = end_tag_id(thinking_server)
    parsed = thinking_client.responses.parse(model=SERVED_NAME, input=QUESTION, text_format=City,
                                             max_output_tokens=80, temperature=1.0,
                                             extra_body={"seed": 1, "logit_bias": {str(end): 3.0}})
    assert [o.type for o in parsed.output] == ["reasoning", "message"]
    assert isinstance(parsed.output_parsed, City) and parsed.status == "completed"
