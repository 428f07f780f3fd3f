"""Anthropic Messages requests as the chat pipeline reads them (no server: the fast loop's
share of test_server_anthropic)."""
from __future__ import annotations

import json
import re

import pytest
from pydantic import ValidationError

from halserve.entrypoints.anthropic.errors import anthropic_error_body, anthropic_error_event
from halserve.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from halserve.entrypoints.anthropic.serving_messages import stop_reason_of
from halserve.entrypoints.openai.errors import BadRequestError, OpenAIError
from halserve.outputs import CompletionOutput

WEATHER = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def parse(**body) -> MessagesRequest:
    return MessagesRequest.model_validate_json(json.dumps({"max_tokens": 8, **body}))


def test_conversation_becomes_chat_messages():
    req = parse(
        system=[{"type": "text", "text": "be "}, {"type": "text", "text": "brief", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "look: "},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAAA"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "x"},
                                              {"type": "text", "text": "checking"},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Lyon"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "18"}, {"type": "text", "text": "C"}]},
                                         {"type": "text", "text": "and tomorrow?"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "ok",
                                          "is_error": True}]},
        ],
        tools=[WEATHER], stop_sequences=["END"], temperature=0.5, top_p=0.9, top_k=4, seed=3,
        metadata={"user_id": "u"},
    )
    chat = req.to_chat_request()
    assert chat.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "look: "}, {"type": "image"}]},
        {"role": "assistant", "content": "checking", "reasoning_content": "hmm", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}]},
        {"role": "tool", "content": "18C", "tool_call_id": "toolu_1"},  # (tool results first)
        {"role": "user", "content": "and tomorrow?"},
        {"role": "tool", "content": "ok", "tool_call_id": "toolu_2"},
    ]
    assert chat.image_urls() == ["data:image/png;base64,AAAA"]
    assert req.first_image_param() == "messages[0].content[1]"
    kwargs = chat.sampling_kwargs()
    assert (kwargs["max_tokens"], kwargs["stop"], kwargs["temperature"], kwargs["top_p"], kwargs["top_k"],
            kwargs["seed"]) == (8, ["END"], 0.5, 0.9, 4, 3)
    assert chat.auto_tools and chat.template_kwargs()["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]


@pytest.mark.parametrize(("choice", "expected", "parallel"), [
    ({"type": "auto"}, "auto", True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}, True),
    ({"type": "none"}, "none", True),
])
def test_tool_choice(choice, expected, parallel):
    chat = parse(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice=choice).to_chat_request()
    assert chat.tool_choice == expected and chat.parallel_tool_calls is parallel
    assert chat.calls_tools == (choice["type"] in ("any", "tool"))


def test_thinking_and_output_config():
    hi = [{"role": "user", "content": "hi"}]
    off = parse(messages=hi, thinking={"type": "disabled"}).to_chat_request()
    assert off.chat_template_kwargs == {"enable_thinking": False} and not off.include_reasoning
    on = parse(messages=hi, thinking={"type": "enabled", "budget_tokens": 2048}).to_chat_request()
    assert on.chat_template_kwargs == {"enable_thinking": True} and on.include_reasoning
    unset = parse(messages=hi).to_chat_request()
    assert unset.chat_template_kwargs is None and unset.include_reasoning
    schema = {"type": "object"}
    fmt = parse(messages=hi, output_config={"format": {"type": "json_schema", "schema": schema}}).to_chat_request()
    assert fmt.sampling_kwargs()["structured_outputs"] == {"json": schema}


@pytest.mark.parametrize(("body", "says"), [
    ({"max_tokens": None}, "max_tokens is required"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, 'top-level "system" field'),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "'document' are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "name": "f"}]}]}, "needs 'id', 'input'"),
    ({"tool_choice": {"type": "any"}}, "needs tools"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "not among the tools (get_weather)"),
    ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "needs the tool's \"name\""),
    ({"tools": [{"name": "web_search", "type": "web_search_20250305"}]}, "server tools are not available"),
    ({"tools": [{"name": "f"}]}, "needs an input_schema"),
    ({"stop_sequences": [""]}, "empty strings"),
    ({"temperature": "hot"}, "temperature"),
])
def test_bad_requests_say_what_is_wrong(body, says):
    full = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(ValidationError, match=re.escape(says)):
        MessagesRequest.model_validate_json(json.dumps({k: v for k, v in full.items() if v is not None}))


def test_blocks_in_the_wrong_turn_are_400s():
    image = {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
    with pytest.raises(BadRequestError, match=r"messages\[1\]\.content\[0\]: an assistant message cannot hold"):
        parse(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": [image]}]).chat_messages()
    tool_use = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    with pytest.raises(BadRequestError, match=r"messages\[0\]\.content\[0\]: a user message cannot hold"):
        parse(messages=[{"role": "user", "content": [tool_use]}]).chat_messages()


def test_count_tokens_needs_no_max_tokens():
    req = CountTokensRequest.model_validate_json(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    assert req.to_chat_request().template_messages() == [{"role": "user", "content": "hi"}]


def test_stop_reasons():
    def output(finish, stop=None):
        return CompletionOutput(index=0, text="x", token_ids=[1], cumulative_logprob=None, logprobs=None,
                                finish_reason=finish, stop_reason=stop)

    assert stop_reason_of(output("stop"), "stop", False) == ("end_turn", None)
    assert stop_reason_of(output("stop", 7), "stop", False) == ("end_turn", None)  # (a stop token id)
    assert stop_reason_of(output("stop", "END"), "stop", False) == ("stop_sequence", "END")
    assert stop_reason_of(output("length"), "length", True) == ("max_tokens", None)
    assert stop_reason_of(output("stop"), "tool_calls", True) == ("tool_use", None)
    with pytest.raises(OpenAIError, match="aborted"):
        stop_reason_of(output("abort"), "abort", False)


def test_error_shapes():
    assert anthropic_error_body("no", 401) == {"type": "error", "error": {"type": "authentication_error",
                                                                          "message": "no"}}
    assert anthropic_error_body("no", 404)["error"]["type"] == "not_found_error"
    assert anthropic_error_body("no", 503)["error"]["type"] == "api_error"
    event = anthropic_error_event(BadRequestError("must be positive", param="max_tokens"))
    name, data = event.strip().split("\n")
    assert name == "event: error"
    assert json.loads(data[len("data: "):]) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: must be positive"}}
