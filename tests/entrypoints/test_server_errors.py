"""Every invalid input is an OpenAI-shaped 400 (unknown model: 404) and leaves the server
serving."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_utils import MAX_MODEL_LEN, SERVED_NAME, VOCAB_SIZE

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

OK = {"model": SERVED_NAME, "prompt": "hello world", "max_tokens": 3}
CHAT_OK = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}

BAD_COMPLETIONS = {
    "empty prompt": {"prompt": ""},
    "empty token list": {"prompt": []},
    "empty token list in batch": {"prompt": [[]]},
    "token id >= vocab": {"prompt": [1, VOCAB_SIZE]},
    "negative token id": {"prompt": [1, -1]},
    "prompt longer than max_model_len": {"prompt": [5] * (MAX_MODEL_LEN + 10)},
    "max_tokens < 1": {"max_tokens": 0},
    "min_tokens > max_tokens": {"min_tokens": 5, "max_tokens": 2},
    "temperature < 0": {"temperature": -0.5},
    "top_p = 0": {"top_p": 0},
    "top_p > 1": {"top_p": 1.5},
    "top_k < -1": {"top_k": -2},
    "min_p > 1": {"min_p": 1.5},
    "min_p < 0": {"min_p": -0.1},
    "presence_penalty > 2": {"presence_penalty": 2.5},
    "frequency_penalty < -2": {"frequency_penalty": -3},
    "repetition_penalty <= 0": {"repetition_penalty": 0},
    "empty stop string": {"stop": [""]},
    "empty stop string (scalar)": {"stop": ""},
    "n > 1 with greedy": {"n": 2, "temperature": 0},
    "logprobs > 20": {"logprobs": 21},
    "wrong type: max_tokens": {"max_tokens": "ten"},
    "wrong type: temperature": {"temperature": "hot"},
    "wrong type: prompt": {"prompt": 5},
    "wrong type: stream": {"stream": "yes"},
    "wrong type: n": {"n": 1.5},
    "wrong type: stop": {"stop": [1, 2]},
    "stream_options without stream": {"stream_options": {"include_usage": True}},
    "logit_bias key not a token id": {"logit_bias": {"x": 1}},
    "logit_bias key negative": {"logit_bias": {"-1": 1}},
    "logit_bias token id >= vocab": {"logit_bias": {str(VOCAB_SIZE): 1}},
    "wrong type: logit_bias value": {"logit_bias": {"5": "high"}},
    "empty allowed_token_ids": {"allowed_token_ids": []},
    "prompt_logprobs > 20": {"prompt_logprobs": 21},
    "prompt_logprobs with stream": {"prompt_logprobs": 1, "stream": True},
    "bad regex": {"structured_outputs": {"regex": "[0-9"}},
    "bad json schema": {"guided_json": {"type": "objectx"}},
    "bad grammar": {"guided_grammar": "root ::= ("},
    "two constraints": {"guided_regex": "a+", "guided_choice": ["a"]},
    "constraint with no field": {"structured_outputs": {}},
    "unknown constraint field": {"structured_outputs": {"xml": "<a/>"}},
    "empty choice": {"guided_choice": []},
    "unknown response_format": {"response_format": {"type": "yaml"}},
    "json_schema without schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    "n huge": {"n": 10**30, "temperature": 1.0},  # (used to build 1e30 requests: the server died of OOM)
    "n over the limit": {"n": 129, "temperature": 1.0},
    "text far longer than the context": {"prompt": "hello world " * 100_000},
    "logit_bias key of 5000 digits": {"logit_bias": {"9" * 5000: 1}},  # (was a 500: int() refuses > 4300 digits)
}
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BAD_CHAT_TOOLS = {
    "tool_choice names no tool": {"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
    "tool_choice without tools": {"tool_choice": "required"},
    "tool without a name": {"tools": [{"type": "function", "function": {"parameters": {}}}], "tool_choice": "required"},
    "tool of another type": {"tools": [{"type": "retrieval"}], "tool_choice": "required"},
    "tool_choice and response_format": {"tools": [_TOOL], "tool_choice": "required",
                                        "response_format": {"type": "json_object"}},
    "allowed_token_ids >= vocab": {"allowed_token_ids": [1, VOCAB_SIZE]},
    # (these three were 500s)
    "tool_choice function a string": {"tools": [_TOOL], "tool_choice": {"type": "function", "function": "f"}},
    "tool_choice function null": {"tools": [_TOOL], "tool_choice": {"type": "function", "function": None}},
    "past tool call function not an object": {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": 5}]}]},
}

BAD_CHAT = {
    "no messages": {"messages": []},
    "unknown role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "image content": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    "max_completion_tokens < 1": {"max_completion_tokens": 0},
    "top_logprobs > 20": {"logprobs": True, "top_logprobs": 21},
    "temperature < 0": {"temperature": -1},
    "stream_options without stream": {"stream_options": {"include_usage": True}},
    "wrong type: messages": {"messages": "hi"},
    "prompt too long": {"messages": [{"role": "user", "content": "hello world " * 100}]},
    "logit_bias token id >= vocab": {"logit_bias": {str(VOCAB_SIZE + 7): -100}},
}


def _check_400(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    return error["message"]


@pytest.mark.parametrize("case", list(BAD_COMPLETIONS), ids=list(BAD_COMPLETIONS))
def test_bad_completion_request_is_400(server, case):
    body = {**OK, **BAD_COMPLETIONS[case]}
    _check_400(httpx.post(server.url + "/v1/completions", json=body, timeout=30))
    if "stream_options" not in body and "stream" not in body:  # the same body, streamed, fails before the stream
        _check_400(httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=30))


@pytest.mark.parametrize("case", list(BAD_CHAT), ids=list(BAD_CHAT))
def test_bad_chat_request_is_400(server, case):
    _check_400(httpx.post(server.url + "/v1/chat/completions", json={**CHAT_OK, **BAD_CHAT[case]}, timeout=30))


@pytest.mark.parametrize("case", list(BAD_CHAT_TOOLS), ids=list(BAD_CHAT_TOOLS))
def test_bad_tool_request_is_400(server, case):
    message = _check_400(httpx.post(server.url + "/v1/chat/completions", json={**CHAT_OK, **BAD_CHAT_TOOLS[case]},
                                    timeout=30))
    if case == "tool_choice names no tool":
        assert "'g', which is not among the tools (f)" in message


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'{"prompt": "a",}', "{\"prompt\": \"\xff\"}".encode("latin-1"),
                                 b'{"prompt": "a", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"])
def test_malformed_json_is_400(server, raw):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
        _check_400(r)


def test_body_over_the_limit_is_413(server):
    """(A 200 MB prompt used to OOM-kill the server.) Declared or streamed, a body over the
    limit (32 MiB by default) is refused before it is all read."""
    big = b'{"prompt": "' + b"a" * (33 * 2**20) + b'"}'
    r = httpx.post(server.url + "/v1/completions", content=big, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "--max-request-body-size" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(33):
            yield b"a" * 2**20
        yield b'"}'

    r = httpx.post(server.url + "/tokenize", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413


def test_null_means_unset_and_routes_vllm_clients_use(server, client):
    """null for a field that cannot be null takes its default (some clients send it);
    GET /v1/models/{id} (the openai client's models.retrieve) and HEAD /health answer."""
    r = httpx.post(server.url + "/v1/completions", json={**OK, "stream": None, "echo": None, "n": None}, timeout=30)
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT_OK, "logprobs": None, "stream": None}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None
    assert client.models.retrieve(SERVED_NAME).id == SERVED_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert httpx.head(server.url + "/health").status_code == 200


def test_messages_name_the_problem(server):
    msg = _check_400(httpx.post(server.url + "/v1/completions", json={**OK, "prompt": [VOCAB_SIZE]}))
    assert str(VOCAB_SIZE) in msg and "range" in msg
    msg = _check_400(httpx.post(server.url + "/v1/completions", json={**OK, "max_tokens": "ten"}))
    assert "max_tokens" in msg
    msg = _check_400(httpx.post(server.url + "/v1/completions", json={**OK, "prompt": [5] * (MAX_MODEL_LEN + 10)}))
    assert "max_model_len" in msg or str(MAX_MODEL_LEN) in msg
    # the field the client sent is the one named
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT_OK, "logprobs": True, "top_logprobs": 21})
    assert "top_logprobs" in _check_400(r)
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT_OK, "max_completion_tokens": 0})
    assert "max_completion_tokens" in _check_400(r)
    r = httpx.post(server.url + "/v1/completions", json={**OK, "temperature": -1})
    assert r.json()["error"]["param"] == "temperature"
    msg = _check_400(httpx.post(server.url + "/v1/completions", json={**OK, "structured_outputs": {"regex": 0}}))
    assert "regex must be a non-empty string, got 0" in msg
    msg = _check_400(httpx.post(server.url + "/v1/completions", json={**OK, "guided_regex": "[0-9"}))
    assert msg.endswith("invalid regex: Regex parsing error at position 5: Unclosed '['"), msg
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT_OK, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": [1, 2]}]}]})
    assert "messages[1].tool_calls[0].function" in _check_400(r)


def test_unknown_model_is_404_and_openai_client_raises(server, client):
    for path, body in (("/v1/completions", OK), ("/v1/chat/completions", CHAT_OK), ("/tokenize", {"prompt": "a"})):
        r = httpx.post(server.url + path, json={**body, "model": "no-such-model"}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="a", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SERVED_NAME, prompt="a", max_tokens=2, temperature=-1)
    assert "temperature" in str(info.value)


def test_still_serves_after_bad_requests(client):
    out = client.completions.create(model=SERVED_NAME, prompt="hello world", max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4


def test_unexpected_error_is_answered_not_raised():
    """A bug in a route is a logged 500 JSON response from the route itself: re-raised to
    Starlette, uvicorn would also drop the client's keep-alive connection."""
    import asyncio

    from halserve.entrypoints.openai.api_server import guarded

    async def broken() -> None:
        raise KeyError("oops")

    response = asyncio.run(guarded(broken)())
    assert response.status_code == 500 and b"KeyError" in response.body


def test_constraint_errors_name_the_field_that_gave_the_constraint(server):
    def param(path, body):
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 400, r.text
        return r.json()["error"]["param"]

    bad_schema = {"type": "nosuchtype"}
    assert param("/v1/completions", {**OK, "guided_json": bad_schema}) == "guided_json"
    assert param("/v1/completions", {**OK, "structured_outputs": {"json": bad_schema}}) == "structured_outputs"
    assert param("/v1/chat/completions", {**CHAT_OK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": bad_schema}}}) == "response_format"
    # token ids of start_after / opened_by past the vocabulary are refused (opened_by used to kill the engine)
    for key, value in (("start_after", [VOCAB_SIZE]), ("opened_by", VOCAB_SIZE + 99999)):
        constraint = {"regex": "a", "start_after": [5], key: value}
        assert param("/v1/completions", {**OK, "structured_outputs": constraint}) == f"structured_outputs.{key}"
    assert httpx.get(server.url + "/health").status_code == 200


def test_cross_field_errors_name_their_param(server):
    """A check across fields (a model validator: pydantic gives it no location) or one of
    SamplingParams' messages names the field in ``param`` too, not only in the message (it used
    to be null)."""
    cases = [
        ("/v1/completions", {**OK, "n": 0}, "n"),
        ("/v1/completions", {**OK, "best_of": 3}, "best_of"),
        ("/v1/completions", {**OK, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {**OK, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {**OK, "logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {**OK, "allowed_token_ids": []}, "allowed_token_ids"),
        ("/v1/completions", {**OK, "guided_choice": []}, "guided_choice"),
        ("/v1/chat/completions", {**CHAT_OK, "top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT_OK, "max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/chat/completions", {**CHAT_OK, "tools": [_TOOL], "tool_choice": {
            "type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ("/v1/chat/completions", {**CHAT_OK, "guided_choice": [""]}, "guided_choice"),
    ]
    for path, body, param in cases:
        r = httpx.post(server.url + path, json=body, timeout=30)
        _check_400(r)
        assert r.json()["error"]["param"] == param, (body, r.text)
        assert param in r.json()["error"]["message"] or param.startswith("guided"), r.text
    assert httpx.post(server.url + "/v1/completions", json=OK, timeout=30).status_code == 200


def test_forced_tool_call_with_a_bad_schema_names_the_tool(server):
    """tool_choice 'required' or a named function generates to the tools' schemas: one that is
    no JSON schema is a 400 on that tool's parameters (it named tool_choice, as if the choice
    were wrong, and "invalid json"); an unused bad tool is no error."""
    tools = [_TOOL, {"type": "function", "function": {"name": "bad", "parameters": {"type": "nosuchtype"}}}]
    for choice in ("required", {"type": "function", "function": {"name": "bad"}}):
        r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT_OK, "tools": tools, "tool_choice": choice},
                       timeout=30)
        message = _check_400(r)
        assert r.json()["error"]["param"] == "tools[1].function.parameters", r.text
        assert "tool 'bad'" in message and "invalid JSON schema" in message and "nosuchtype" in message, message
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        **CHAT_OK, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert r.status_code == 200, r.text
    # a response_format's bad schema says so too
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={**CHAT_OK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuchtype"}}}})
    assert "invalid JSON schema" in _check_400(r) and r.json()["error"]["param"] == "response_format"


def test_chat_template_kwargs_cannot_set_what_the_server_passes(server):
    """chat_template_kwargs with a key the server gives the template itself was a 400 on
    ``messages`` quoting a TypeError from transformers ("got multiple values for keyword
    argument 'tokenize'"); it is a 400 on chat_template_kwargs saying what to do instead."""
    for key, value, words in (("tokenize", True, "tokenizes it itself"), ("chat_template", "{{ 'x' }}", "--chat-template"),
                              ("add_generation_prompt", False, "request's own add_generation_prompt"),
                              ("messages", [], "request's messages")):
        for path, body in (("/v1/chat/completions", CHAT_OK), ("/tokenize", {"messages": CHAT_OK["messages"]})):
            r = httpx.post(server.url + path, json={**body, "chat_template_kwargs": {key: value}}, timeout=30)
            message = _check_400(r)
            assert r.json()["error"]["param"] == "chat_template_kwargs", r.text
            assert repr(key) in message and words in message, message
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT_OK, "chat_template_kwargs": {"x": 1}}, timeout=30)
    assert r.status_code == 200, r.text


def test_json_pydantic_refuses_is_an_invalid_json_400(server):
    """What Python's json module takes but pydantic's parser does not (a number past a float's
    range, a lone surrogate escape, nesting past 200 levels) is an invalid_json 400 that says
    so, like other malformed bodies; a UTF-8 byte order mark is skipped (it was a bare
    "Invalid JSON: expected value at line 1 column 1")."""
    cases = (
        (b'{"prompt": "hi", "temperature": 1' + b"0" * 5000 + b'.5}', "not valid JSON: number out of range"),
        (b'{"prompt": "\\ud800"}', "not valid JSON"),
        (b'{"prompt": "hi", "x": ' + b"[" * 300 + b"]" * 300 + b"}", "too deeply"),
    )
    for raw, words in cases:
        r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                       timeout=30)
        message = _check_400(r)
        assert r.json()["error"]["code"] == "invalid_json" and words in message, r.text
    bom = b"\xef\xbb\xbf" + json.dumps(OK).encode()
    r = httpx.post(server.url + "/v1/completions", content=bom, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/tokenize", json={"prompt": ["a"]}, timeout=30)
    assert "prompt: must be a string" in _check_400(r) and "token ids" not in r.text  # (/tokenize takes text only)
