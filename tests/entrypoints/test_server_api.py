"""The OpenAI-compatible endpoints, through the official ``openai`` client and raw HTTP."""
from __future__ import annotations

import json

import httpx
import pytest
from server_utils import MAX_MODEL_LEN, SERVED_NAME, VOCAB_SIZE

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

PROMPT = "the quick brown fox"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me about paris"}]


def test_models_version_health(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [SERVED_NAME]
    card = models[0].model_dump()
    assert card["object"] == "model" and card["owned_by"] == "halserve"
    assert card["max_model_len"] == MAX_MODEL_LEN and card["root"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_completion_stream_equals_non_stream_and_usage(client, server):
    kwargs = dict(model=SERVED_NAME, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length"
    n_prompt = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert full.usage.prompt_tokens == n_prompt
    assert full.usage.completion_tokens == 12 and full.usage.total_tokens == n_prompt + 12

    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    # raw SSE framing: data lines, ending with [DONE]
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    raw = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    events = [e for e in raw.text.split("\n\n") if e]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_chat_stream_equals_non_stream(client):
    kwargs = dict(model=SERVED_NAME, messages=MESSAGES, max_completion_tokens=10, temperature=0)
    full = client.chat.completions.create(**kwargs)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert 1 <= full.usage.completion_tokens <= 10
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # deprecated max_tokens still works; list-of-text-parts content renders like a string
    parts = [{"role": "user", "content": [{"type": "text", "text": "tell me "}, {"type": "text", "text": "about paris"}]}]
    a = client.chat.completions.create(model=SERVED_NAME, messages=parts, max_tokens=5, temperature=0)
    b = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "tell me about paris"}], max_tokens=5, temperature=0
    )
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_token_id_prompts_batches_n_and_echo(client):
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    out = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == 7 and out.usage.completion_tokens == 8
    single = client.completions.create(model=SERVED_NAME, prompt=ids[1], max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert single.choices[0].text == out.choices[1].text

    sampled = client.completions.create(model=SERVED_NAME, prompt=PROMPT, n=3, max_tokens=4, temperature=1.0, seed=7)
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]
    again = client.completions.create(model=SERVED_NAME, prompt=PROMPT, n=3, max_tokens=4, temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]  # seeded: reproducible

    echoed = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_logprobs_formats(client):
    out = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(3 <= len(d) <= 4 for d in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == out.choices[0].text

    chat = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_completion_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    # greedy: the sampled token is the most likely one
    assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-4 for t in content)


def test_stop_strings_and_extras(client):
    base = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[3:5]
    assert len(stop) == 2 and stop not in text[:4], text  # the tiny model's text has room for a stop string
    if stop:
        cut = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
        assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
        assert text.startswith(cut.choices[0].text)
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                               stop=[stop], stream=True, extra_body={"ignore_eos": True})
        )
        assert streamed == cut.choices[0].text
    extras = client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=6, temperature=0.8, seed=1,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 6, "ignore_eos": True,
                    "stop_token_ids": [3], "skip_special_tokens": True},
    )
    assert extras.usage.completion_tokens == 6


def test_echo_with_logprobs_scores_the_prompt(client):
    """What lm-evaluation-harness sends for loglikelihoods: echo, logprobs=1, max_tokens=1."""
    tokens = [11, 40, 97, 3, 250, 18, 7]
    out = client.completions.create(model=SERVED_NAME, prompt=tokens, max_tokens=1, temperature=0, echo=True,
                                    logprobs=1, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(tokens) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing scores the first token
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(d) <= 2 for d in lp.top_logprobs[1:])
    # a token's logprob is the same sampled after the prompt and scored as part of a longer
    # prompt (allowed_token_ids picks the token; logprobs are the model's, unrestricted)
    forced = 123
    sampled = client.completions.create(model=SERVED_NAME, prompt=tokens, max_tokens=1, temperature=0, logprobs=0,
                                        extra_body={"ignore_eos": True, "allowed_token_ids": [forced]})
    rescored = client.completions.create(model=SERVED_NAME, prompt=tokens + [forced], max_tokens=1, temperature=0,
                                         echo=True, logprobs=0, extra_body={"ignore_eos": True})
    again = rescored.choices[0].logprobs.token_logprobs
    assert abs(again[len(tokens)] - sampled.choices[0].logprobs.token_logprobs[0]) < 1e-4
    assert again[1 : len(tokens)] == pytest.approx(lp.token_logprobs[1 : len(tokens)], abs=1e-4)
    # max_tokens 0 with echo: the prompt scored, nothing generated (whole and streamed)
    text_prompt = "hello world, tell me about paris"
    for stream in (False, True):
        extra = {"stream_options": {"include_usage": True}} if stream else {}
        results = []
        for prompt in (tokens, text_prompt):
            got = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                            stream=stream, **extra)
            chunks = list(got) if stream else [got]
            (choice,) = [c for chunk in chunks for c in chunk.choices]
            assert choice.finish_reason == "length" and chunks[-1].usage.completion_tokens == 0
            results.append((choice, chunks[-1].usage.prompt_tokens))
        (only, only_count), (texty, texty_count) = results
        assert only_count == len(only.logprobs.tokens) == len(tokens)
        assert only.logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:-1], abs=1e-4)
        assert texty.text == text_prompt and texty_count == len(texty.logprobs.tokens)
        assert "".join(texty.logprobs.tokens[1:]) == text_prompt  # (BOS, then the text)
    # streamed, the first chunk carries the echoed prompt's logprobs
    chunks = list(client.completions.create(model=SERVED_NAME, prompt=tokens, max_tokens=2, temperature=0, echo=True,
                                            logprobs=1, stream=True, extra_body={"ignore_eos": True}))
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None
    assert first.token_logprobs[1:len(tokens)] == pytest.approx(lp.token_logprobs[1:len(tokens)], abs=1e-4)
    # vLLM's prompt_logprobs extra: {token id: {logprob, rank, decoded_token}} per prompt token
    raw = client.completions.create(model=SERVED_NAME, prompt=tokens, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 2, "ignore_eos": True})
    scored = raw.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(tokens)
    for pos in range(1, len(tokens)):
        entry = scored[pos][str(tokens[pos])]
        assert entry["logprob"] == pytest.approx(lp.token_logprobs[pos], abs=1e-4) and entry["rank"] >= 1
        assert 1 <= len(scored[pos]) <= 3
    chat = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_completion_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 5
    assert raw.choices[0].logprobs is None and client.completions.create(
        model=SERVED_NAME, prompt=tokens, max_tokens=1).choices[0].model_extra["prompt_logprobs"] is None


SCHEMA = {
    "type": "object",
    # (no maxLength: xgrammar 0.2.8 lets length-bounded strings hold raw control characters)
    "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]}, "population": {"type": "integer", "minimum": 0},
                   "capital": {"type": "boolean"}},
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}


def test_structured_outputs(client):
    """Every way a client asks for a constrained output; the tiny model's random weights would
    never produce these by chance, so each one shows the constraint at work."""
    import re

    chat = dict(model=SERVED_NAME, messages=MESSAGES, max_completion_tokens=105, temperature=1.0, seed=3)  # (128 - the 23-token prompt)
    for fmt in ({"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},):
        out = json.loads(client.chat.completions.create(response_format=fmt, **chat).choices[0].message.content)
        assert set(out) == {"city", "population", "capital"} and isinstance(out["population"], int)
        assert isinstance(out["capital"], bool) and out["city"] in ("Paris", "Lyon", "Nice")
    # any JSON object: the random model may write one long string and run out of tokens, but it
    # always opens an object, and every run that ends by itself ends with a whole one
    objects = [client.chat.completions.create(response_format={"type": "json_object"}, **chat | {"seed": seed})
               for seed in range(6)]
    assert all(o.choices[0].message.content.startswith("{") for o in objects)
    finished = [json.loads(o.choices[0].message.content) for o in objects if o.choices[0].finish_reason == "stop"]
    assert finished and all(isinstance(o, dict) for o in finished)
    base = dict(model=SERVED_NAME, prompt=PROMPT, max_tokens=40, temperature=1.0)
    for seed in range(3):
        regex = client.completions.create(seed=seed, extra_body={"structured_outputs": {"regex": "[a-z]{2,5}-[0-9]{3}"}},
                                          **base).choices[0].text
        assert re.fullmatch("[a-z]{2,5}-[0-9]{3}", regex), regex
        choice = client.completions.create(seed=seed, extra_body={"guided_choice": ["red", "green", "blue"]},
                                           **base).choices[0].text
        assert choice in ("red", "green", "blue")
    # (the random model may list numbers until max_tokens: then the text is a start of the grammar's)
    for seed in range(3):
        numbers = {"guided_grammar": 'root ::= "<" [0-9]+ ("," [0-9]+)* ">"'}
        grammar = client.completions.create(seed=seed, extra_body=numbers, **base).choices[0]
        if grammar.finish_reason == "stop":
            assert re.fullmatch(r"<[0-9]+(,[0-9]+)*>", grammar.text), grammar.text
        else:
            assert re.fullmatch(r"<[0-9]+(,[0-9]*)*", grammar.text), grammar.text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        stream=True, extra_body={"guided_json": SCHEMA}, **base | {"max_tokens": 116}))
    assert set(json.loads(streamed)) == {"city", "population", "capital"}
    # an unconstrained request after them is unconstrained
    free = client.completions.create(seed=0, **base).choices[0].text
    assert not re.fullmatch("[a-z]{2,5}-[0-9]{3}", free)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_forced_tool_calls(client):
    chat = dict(model=SERVED_NAME, messages=MESSAGES, max_completion_tokens=105, temperature=1.0, seed=1,
                tools=[WEATHER, TIME])
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           **chat).choices[0]
    (call,) = named.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool")
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Lyon") and args["unit"] in ("C", "F")
    assert named.message.content is None and named.finish_reason == "stop"
    streamed = list(client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True, **chat))
    (streamed_call,) = [call for c in streamed if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert streamed_call.function.arguments == call.function.arguments  # the same seed: the same call
    names = set()
    for seed in range(4):  # one call (parallel_tool_calls false), of either tool
        required = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False,
                                                  **chat | {"seed": seed}).choices[0]
        assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1
        call = required.message.tool_calls[0]
        args = json.loads(call.function.arguments)
        assert (call.function.name, set(args)) in (("get_weather", {"city", "unit"}), ("get_time", {"zone"}))
        names.add(call.function.name)
    assert names == {"get_weather", "get_time"}
    # parallel calls allowed: the random model may keep adding calls until max_tokens; a reply cut
    # short is not a whole array and stays text, a whole one is one call per item
    parallel = client.chat.completions.create(tool_choice="required", **chat).choices[0]
    if parallel.finish_reason == "tool_calls":
        assert parallel.message.tool_calls and parallel.message.content is None
    else:
        assert parallel.finish_reason == "length" and parallel.message.content.startswith("[")
    # the reply goes back as a multi-turn conversation: an assistant's tool_calls and a tool message
    follow_up = client.chat.completions.create(
        model=SERVED_NAME, max_completion_tokens=3, tools=[WEATHER], tool_choice="none",
        messages=MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                             {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}])
    assert follow_up.choices[0].message.content is not None and not follow_up.choices[0].message.tool_calls


def test_auto_tool_choice_parses_the_models_calls(client):
    """The server runs with --tool-call-parser hermes: the model's <tool_call> blocks become
    tool_calls. The tiny random model is made to write one (guided_choice), with text around."""
    written = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "C"}}'
               '\n</tool_call>')
    chat = dict(model=SERVED_NAME, messages=MESSAGES, max_completion_tokens=100, tools=[WEATHER, TIME])
    out = client.chat.completions.create(extra_body={"guided_choice": [written]}, **chat).choices[0]
    (call,) = out.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Lyon", "unit": "C"})
    assert out.message.content == "Let me check." and out.finish_reason == "tool_calls"
    plain = client.chat.completions.create(extra_body={"guided_choice": ["no tools needed"]}, **chat).choices[0]
    assert plain.message.content == "no tools needed" and not plain.message.tool_calls
    assert plain.finish_reason == "stop"
    # streamed: the text as content, then the call's id and name, then its arguments as they are written
    chunks = list(client.chat.completions.create(stream=True, extra_body={"guided_choice": [written]}, **chat))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and chunks[-1].choices[0].finish_reason == "tool_calls"
    pieces = [call for d in deltas for call in d.tool_calls or []]
    assert pieces[0].index == 0 and pieces[0].function.name == "get_weather" and pieces[0].id.startswith("chatcmpl-tool")
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == {"city": "Lyon", "unit": "C"}
    assert "".join(d.content or "" for d in deltas) == "Let me check."


def test_hermes_parser():
    from halserve.entrypoints.openai.tool_parsers import parse_hermes

    text = ('a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> b '
            '<tool_call>not json</tool_call><tool_call>\n{"name": "g", "arguments": "{}"}\n</tool_call>')
    content, calls = parse_hermes(text)
    assert calls == [("f", '{"x": 1}'), ("g", "{}")]
    assert content == "a  b <tool_call>not json</tool_call>"  # a block that is not a call stays text
    assert parse_hermes("just text") == ("just text", [])
    assert parse_hermes('<tool_call>{"name": "f"}</tool_call>') == (None, [("f", "{}")])
    # with the request's tools and parallel_tool_calls: blocks that are no call of them stay text
    text = ('<tool_call>{"name": "zzz", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "f", "arguments": 5}</tool_call>'
            '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'
            '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    content, calls = parse_hermes(text, {"f", "g"}, None)
    assert calls == [("f", '{"x": 1}'), ("g", "{}")] and "zzz" in content and "NaN" in content
    content, calls = parse_hermes(text, {"f", "g"}, 1)
    assert calls == [("f", '{"x": 1}')] and content.endswith('<tool_call>{"name": "g", "arguments": {}}</tool_call>')


def test_tools_reach_the_chat_template():
    from model_factory import make_tokenizer

    from halserve.entrypoints.openai.chat_protocol import ChatCompletionRequest
    from halserve.entrypoints.openai.serving_chat import render_chat

    template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments.city }}>{% endfor %}"
                "{% endfor %}")
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
                         "name": "get_weather", "arguments": '{"city": "Lyon", "unit": "C"}'}}]}],
        "tools": [WEATHER, TIME], "tool_choice": "required"})
    text, _ = render_chat(make_tokenizer(300), req.template_messages(), template, template_kwargs=req.template_kwargs())
    assert text == "[get_weather][get_time]user:hiassistant:<get_weather Lyon>"


def test_return_tokens_as_token_ids(client):
    tokens = [11, 40, 97]
    out = client.completions.create(model=SERVED_NAME, prompt=tokens, max_tokens=3, temperature=0, logprobs=2,
                                    echo=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = out.choices[0].logprobs
    assert lp.tokens[:3] == [f"token_id:{t}" for t in tokens]
    assert all(t.startswith("token_id:") for t in lp.tokens) and all(
        k.startswith("token_id:") for d in lp.top_logprobs[1:] for k in d)
    for stream in (False, True):
        chat = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_completion_tokens=3,
                                              temperature=0, logprobs=True, top_logprobs=1, stream=stream,
                                              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        content = ([t for c in chat if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
                   if stream else chat.choices[0].logprobs.content)
        assert len(content) == 3 and all(t.token.startswith("token_id:") for t in content)
        assert all(int(t.token.split(":")[1]) >= 0 for t in content)


def test_logit_bias_and_allowed_token_ids(client, server):
    forced = VOCAB_SIZE - 7
    want = httpx.post(server.url + "/detokenize", json={"tokens": [forced] * 5}).json()["prompt"]
    # OpenAI's range is [-100, 100]: 1000 is clamped to 100, which still forces the token
    for bias in (100, 1000):
        out = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                                        logit_bias={str(forced): bias}, extra_body={"ignore_eos": True})
        assert out.choices[0].text == want
    chat = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_completion_tokens=5,
                                          temperature=0, logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == want
    only = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=0,
                                     extra_body={"allowed_token_ids": [forced], "ignore_eos": True})
    assert only.choices[0].text == want
    # the next request without them is unaffected
    plain = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].text != want


def test_tokenize_detokenize(server):
    tok = httpx.post(server.url + "/tokenize", json={"model": SERVED_NAME, "prompt": PROMPT}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    detok = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert PROMPT in detok["prompt"]
    chat = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > tok["count"]
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [VOCAB_SIZE]})
    assert bad.status_code == 400 and "out of range" in bad.json()["error"]["message"]
