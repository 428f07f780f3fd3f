"""/v1/responses function tools as chat's: the request's tools, tool_choice and the
function_call / function_call_output input items (no server)."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from halserve.entrypoints.openai.responses_protocol import ResponsesRequest

WEATHER = {"type": "function", "name": "get_weather", "description": "now", "parameters": {"type": "object"}}


def test_function_tools_and_items_become_chat_fields():
    req = ResponsesRequest.model_validate({
        "model": "m", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False,
        "input": [{"role": "user", "content": "weather?"},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
                  {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "18C"},
                  {"type": "function_call_output", "call_id": "c2", "output": "20C"}],
    })
    chat = req.chat_request()
    assert [t.function.name for t in chat.tools] == ["get_weather"] and chat.tools[0].function.description == "now"
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}} and chat.calls_tools
    assert chat.parallel_tool_calls is False
    user, assistant, tool1, tool2 = chat.template_messages()
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]  # one turn's calls: one message
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Lyon"}
    assert (tool1["role"], tool1["tool_call_id"], tool1["content"]) == ("tool", "c1", "18C")
    assert tool2["tool_call_id"] == "c2"
    auto = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [WEATHER]}).chat_request()
    assert auto.auto_tools


@pytest.mark.parametrize("fields, words", [
    ({"tools": [{"type": "web_search"}]}, "only function tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice is 'none', 'auto', 'required'"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c"}]},
     "needs name, arguments"),
])
def test_what_cannot_be_a_function_tool_is_refused(fields, words):
    with pytest.raises(ValidationError, match=words):
        ResponsesRequest.model_validate({"model": "m", "input": "hi"} | fields)
