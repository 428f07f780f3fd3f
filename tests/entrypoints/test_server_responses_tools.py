"""/v1/responses with function tools: the calls the model writes (the session server's hermes
parser) come back as function_call items, whole or streamed as argument deltas; the calls and
their results go back as input items. The tiny random model is made to write a call (guided_choice)."""
from __future__ import annotations

import json

import httpx
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from server_utils import SERVED_NAME

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
WRITTEN = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "C"}}\n</tool_call>'
EVENTS = TypeAdapter(ResponseStreamEvent)


def test_function_call_items(client):
    out = client.responses.create(model=SERVED_NAME, input="hi", tools=[WEATHER], max_output_tokens=100,
                                  extra_body={"guided_choice": [WRITTEN]})
    assert out.status == "completed" and [item.type for item in out.output] == ["message", "function_call"]
    assert out.output_text == "Let me check."
    call = out.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Lyon", "unit": "C"}
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert out.tools[0].name == "get_weather"
    # the call and its result go back as input items of the next turn
    follow_up = client.responses.create(model=SERVED_NAME, max_output_tokens=3, tools=[WEATHER], tool_choice="none",
                                        input=[{"role": "user", "content": "hi"}, call.model_dump(),
                                               {"type": "function_call_output", "call_id": call.call_id,
                                                "output": "18 degrees"}])
    assert follow_up.status in ("completed", "incomplete") and all(i.type == "message" for i in follow_up.output)
    # a forced call: generated to the tool's schema
    forced = client.responses.create(model=SERVED_NAME, input="hi", tools=[WEATHER], max_output_tokens=100,
                                     tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    (item,) = forced.output
    assert item.type == "function_call" and json.loads(item.arguments)["city"] in ("Paris", "Lyon")


def test_streamed_function_call_arguments(client, server):
    whole = client.responses.create(model=SERVED_NAME, input="hi", tools=[WEATHER], max_output_tokens=100,
                                    extra_body={"guided_choice": [WRITTEN]})
    body = {"model": SERVED_NAME, "input": "hi", "tools": [WEATHER], "max_output_tokens": 100, "stream": True,
            "guided_choice": [WRITTEN]}
    raw = httpx.post(server.url + "/v1/responses", json=body, timeout=60).text
    events = [json.loads(block.split("\n")[1].removeprefix("data: ")) for block in filter(None, raw.split("\n\n"))]
    for event in events:
        EVENTS.validate_python(event)  # (the client's event types)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["item"]["type"] for e in added] == ["message", "function_call"]
    assert added[1]["item"]["name"] == "get_weather" and added[1]["output_index"] == 1
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert len(deltas) > 1 and "".join(deltas) == done["arguments"] == whole.output[1].arguments
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Let me check."
    completed = events[-1]
    assert completed["type"] == "response.completed"
    assert [i["type"] for i in completed["response"]["output"]] == ["message", "function_call"]
    assert completed["response"]["output"][1]["arguments"] == done["arguments"]
