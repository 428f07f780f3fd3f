"""--reasoning-parser: a thinking model's <think>...</think> goes to the message's reasoning
field, the rest to content; structured outputs and forced tool calls apply after the thinking.

The server runs a tiny random checkpoint whose tokenizer has <think> and </think> as tokens and
a Qwen3-like chat template: the prompt opens a think block unless ``enable_thinking`` is false
(then it ends with an empty, closed one) or ``open_think`` is false (then the model may open
one). The random model is nudged to close its thinking with logit_bias on </think>; the raw text of the same seeded generation, read through
/v1/completions on the rendered prompt, is what the parsed reply is checked against."""
from __future__ import annotations

import json
import re

import httpx
import pytest
from server_utils import SERVED_NAME

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

pytest.importorskip("xgrammar", reason="structured outputs need the structured-outputs extra (in dev)")

MESSAGES = [{"role": "user", "content": "tell me about the quick brown fox"}]


@pytest.fixture(scope="module")
def client(thinking_server):
    import openai

    return openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def token_id(server, text: str) -> int:
    (tid,) = httpx.post(server.url + "/tokenize", json={"model": SERVED_NAME, "prompt": text,
                                                        "add_special_tokens": False}).json()["tokens"]
    return tid


def raw_text(server, client, sampling: dict, **template) -> str:
    """The text the same seeded generation gives without parsing (/v1/completions on the
    rendered chat prompt)."""
    prompt = httpx.post(server.url + "/tokenize", json={"model": SERVED_NAME, "messages": MESSAGES, **template})
    out = client.completions.create(model=SERVED_NAME, prompt=prompt.json()["tokens"], **sampling)
    return out.choices[0].text


def test_reasoning_and_content_split_at_the_end_tag(thinking_server, client):
    end = token_id(thinking_server, "</think>")
    sampling = dict(max_tokens=24, temperature=1.0, seed=3, logit_bias={str(end): 4.0})
    raw = raw_text(thinking_server, client, sampling)
    assert raw.count("</think>") >= 1, raw  # (the nudge works: the test would say nothing otherwise)
    thought, rest = raw.split("</think>", 1)
    reply = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, **sampling).choices[0]
    message = reply.message.model_dump()
    assert message["reasoning"] == message["reasoning_content"] == (thought.lstrip() or None)
    assert message["content"] == (rest.lstrip() or None)
    # streamed: reasoning deltas, then content deltas; together the same two texts
    chunks = list(client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, stream=True, **sampling))
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    streamed_reasoning = "".join(d.get("reasoning") or "" for d in deltas)
    streamed_content = "".join(d.get("content") or "" for d in deltas)
    assert streamed_reasoning == (message["reasoning"] or "") and streamed_content == (message["content"] or "")
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    last_reasoning = max(i for i, d in enumerate(deltas) if d.get("reasoning"))
    assert not any(d.get("content") for d in deltas[:last_reasoning]), "content came before the reasoning ended"
    assert not any("think>" in (d.get("reasoning") or "") + (d.get("content") or "") for d in deltas)
    # include_reasoning false: the same reply without its reasoning
    bare = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, extra_body={"include_reasoning": False},
                                          **sampling).choices[0].message.model_dump()
    assert bare["reasoning"] is None and bare["content"] == message["content"]


def test_unfinished_thinking_is_all_reasoning(thinking_server, client):
    end = token_id(thinking_server, "</think>")
    sampling = dict(max_tokens=8, temperature=1.0, seed=5, logit_bias={str(end): -100.0})
    raw = raw_text(thinking_server, client, sampling)
    reply = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, **sampling).choices[0]
    assert reply.finish_reason == "length"
    assert reply.message.content is None and reply.message.model_dump()["reasoning"] == raw.lstrip()


def test_thinking_off_is_all_content(thinking_server, client):
    """enable_thinking false: the prompt closes an empty think block, the reply is content even
    where the model writes the tag."""
    end = token_id(thinking_server, "</think>")
    sampling = dict(max_tokens=16, temperature=1.0, seed=3, logit_bias={str(end): 4.0})
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    raw = raw_text(thinking_server, client, sampling, **kwargs)
    reply = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, extra_body=kwargs, **sampling)
    message = reply.choices[0].message.model_dump()
    assert message["reasoning"] is None and message["content"] == raw


def test_structured_output_applies_after_the_thinking(thinking_server, client):
    """The grammar waits for </think>: the model thinks freely (the tag is not a choice, so a
    grammar applied from the start would never let it through), then answers one of the choices."""
    end = token_id(thinking_server, "</think>")
    choices = ["yes please", "no thanks"]
    seen_reasoning = False
    for seed in range(4):
        sampling = dict(max_tokens=40, temperature=1.0, seed=seed, logit_bias={str(end): 3.0})
        reply = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES,
                                               extra_body={"structured_outputs": {"choice": choices}}, **sampling)
        message = reply.choices[0].message.model_dump()
        assert message["content"] in choices and reply.choices[0].finish_reason == "stop", message
        seen_reasoning |= bool(message["reasoning"])
    assert seen_reasoning
    # the content is exactly what the grammar generated (leading spaces included)
    reply = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=20, temperature=0,
                                           logit_bias={str(end): 100.0},
                                           extra_body={"structured_outputs": {"regex": "  x[0-9]"}})
    assert re.fullmatch("  x[0-9]", reply.choices[0].message.content), reply.choices[0].message
    # the same with a JSON schema through response_format
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    reply = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=40, temperature=1.0, seed=1, logit_bias={str(end): 3.0},
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    assert isinstance(json.loads(reply.choices[0].message.content)["ok"], bool)
    # thinking off: the grammar applies from the first token, nothing is reasoning
    off = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=40, seed=0,
                                         extra_body={"structured_outputs": {"choice": choices},
                                                     "chat_template_kwargs": {"enable_thinking": False}})
    message = off.choices[0].message.model_dump()
    assert message["content"] in choices and message["reasoning"] is None


def test_constraint_when_the_model_may_open_its_thinking(thinking_server, client):
    """Qwen3's original template leaves opening the think block to the model: the first token
    is <think> (then the constraint waits for </think>) or one the constraint allows (then it
    applies from there). It must never wait for a </think> that is not coming."""
    start, end = token_id(thinking_server, "<think>"), token_id(thinking_server, "</think>")
    maybe = {"chat_template_kwargs": {"open_think": False}}
    json_object = {"type": "json_object"}
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"enum": ["fox", "dog"]}}, "required": ["q"]}}}
    for seed in range(3):  # no thinking: constrained from the first token
        sampling = dict(max_tokens=60, temperature=1.0, seed=seed, logit_bias={str(start): -100.0})
        reply = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, response_format=json_object,
                                               extra_body=maybe, **sampling).choices[0]
        message = reply.message.model_dump()
        assert message["reasoning"] is None and message["content"].startswith("{"), message
        if reply.finish_reason == "stop":
            assert isinstance(json.loads(message["content"]), dict)
        call = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, tools=[tool],
                                              tool_choice="required", extra_body=maybe, **sampling).choices[0]
        assert call.finish_reason == "tool_calls" and call.message.content is None
        assert json.loads(call.message.tool_calls[0].function.arguments)["q"] in ("fox", "dog")
    # the model opens its thinking (both tags pushed up: the grammar's gate lets <think> in as
    # the first token, keeps </think> out of it, and after </think> the object follows)
    reply = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, response_format=json_object, extra_body=maybe, max_tokens=60,
        temperature=1.0, seed=0, logprobs=True, logit_bias={str(start): 100.0, str(end): 100.0}).choices[0]
    tokens = [t.token for t in reply.logprobs.content]
    assert tokens[0] == "<think>" and "</think>" in tokens, tokens
    assert reply.finish_reason == "stop" and isinstance(json.loads(reply.message.content), dict)


def test_forced_tool_call_after_the_thinking(thinking_server, client):
    end = token_id(thinking_server, "</think>")
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"enum": ["fox", "dog"]}}, "required": ["q"]}}}
    reply = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=60, temperature=1.0, seed=2, logit_bias={str(end): 3.0},
        tools=[tool], tool_choice={"type": "function", "function": {"name": "lookup"}}).choices[0]
    (call,) = reply.message.tool_calls
    assert call.function.name == "lookup" and set(json.loads(call.function.arguments)) == {"q"}
    assert reply.message.content is None


def test_earlier_reasoning_reaches_the_template(thinking_server):
    """An assistant turn's reasoning (vLLM's 'reasoning' or the older 'reasoning_content') is
    given to the chat template as reasoning_content."""
    for field in ("reasoning", "reasoning_content"):
        messages = MESSAGES + [{"role": "assistant", "content": "fox", field: "hmm"},
                               {"role": "user", "content": "more"}]
        r = httpx.post(thinking_server.url + "/tokenize", json={"model": SERVED_NAME, "messages": messages})
        assert r.status_code == 200
        text = httpx.post(thinking_server.url + "/detokenize",
                          json={"model": SERVED_NAME, "tokens": r.json()["tokens"]}).json()["prompt"]
        assert "<think>hmm</think>fox" in text


def test_parser_streaming_parts_only_grow():
    """Every prefix of a reply splits into parts that extend the previous prefix's parts, and the
    last split equals the whole text's."""
    from halserve.entrypoints.openai.reasoning import REASONING_PARSERS, ReplyStart

    parser = REASONING_PARSERS["qwen3"]
    cases = [
        (ReplyStart.REASONING, "\nlet me see</think>\n\nthe answer", ("let me see", "the answer")),
        (ReplyStart.REASONING, "<think>a < b</thin</think>c", ("a < b</thin", "c")),
        (ReplyStart.REASONING, "still thinking <", ("still thinking <", None)),
        (ReplyStart.REASONING, "</think>", (None, None)),
        (ReplyStart.MAYBE, "<think>x</think>y", ("x", "y")),
        (ReplyStart.MAYBE, "plain </think> text", (None, "plain </think> text")),
        (ReplyStart.MAYBE, "<thi", (None, "<thi")),
        (ReplyStart.CONTENT, "<think>x</think>y", (None, "<think>x</think>y")),
    ]
    for start, text, expected in cases:
        assert parser.split(text, start) == expected, (start, text)
        sent = ("", "")
        for n in range(len(text) + 1):
            parts = tuple(p or "" for p in parser.split(text[:n], start, final=n == len(text)))
            assert parts[0].startswith(sent[0]) and parts[1].startswith(sent[1]), (text[:n], sent, parts)
            sent = parts
        assert sent == tuple(p or "" for p in expected)
    assert parser.reply_start("<|assistant|>\n<think>\n") is ReplyStart.REASONING
    assert parser.reply_start("<|assistant|>\n<think>\n\n</think>\n\n") is ReplyStart.CONTENT
    assert parser.reply_start("<think>old</think>answer<|user|>\nq<|assistant|>\n") is ReplyStart.MAYBE
    # a tag a user wrote is text: only the prompt's end counts
    assert parser.reply_start("<|user|>\nwhat does <think> do?<|assistant|>\n") is ReplyStart.MAYBE
    assert parser.reply_start("<|user|>\nsay </think><|assistant|>\n") is ReplyStart.MAYBE
    # the content a constraint generated keeps its whitespace
    assert parser.split("<think>x</think>  y", ReplyStart.MAYBE, exact=True) == ("x", "  y")
    assert REASONING_PARSERS["deepseek_r1"].reply_start("<|assistant|>\n") is ReplyStart.REASONING
