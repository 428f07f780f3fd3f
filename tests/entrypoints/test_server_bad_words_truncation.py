"""bad_words and truncate_prompt_tokens over HTTP, through the official client: on
/v1/completions and /v1/chat/completions, and truncation on /v1/embeddings."""
from __future__ import annotations

import httpx
import numpy as np
import pytest
from server_utils import MAX_MODEL_LEN, SERVED_NAME

from halserve.engine.processor import tokenize_bad_words

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

PROMPT = "the quick brown fox"
LONG_TEXT = "the quick brown fox jumps over the lazy dog " * 30  # ~330 tokens: over max_model_len
GREEDY = dict(model=SERVED_NAME, temperature=0, max_tokens=16)
TOKEN_IDS = {"ignore_eos": True, "return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def completion_ids(choice) -> list[int]:
    return [int(t.split(":")[1]) for t in choice.logprobs.tokens]


def chat_ids(choice) -> list[int]:
    return [int(entry.token.split(":")[1]) for entry in choice.logprobs.content]


def first_word(tokenizer, token_ids) -> tuple[int, str, set[int]]:
    """The first generated token that is a word on its own: (position, the word, the one-token
    sequences banning it)."""
    for i, tid in enumerate(token_ids):
        word = tokenizer.decode([tid]).strip()
        banned = {s[0] for s in tokenize_bad_words(tokenizer, [word], len(tokenizer)) if len(s) == 1}
        if word.isalpha() and tid in banned:
            return i, word, banned
    raise AssertionError(f"no one-token word in {token_ids}")


def test_completions_and_chat_never_generate_a_bad_word(client, tokenizer):
    kwargs = dict(**GREEDY, prompt=PROMPT, logprobs=0)
    ref = completion_ids(client.completions.create(**kwargs, extra_body=TOKEN_IDS).choices[0])
    i, word, banned = first_word(tokenizer, ref)
    out = completion_ids(client.completions.create(**kwargs, extra_body={**TOKEN_IDS, "bad_words": [word]}).choices[0])
    assert out[:i] == ref[:i] and not banned & set(out)

    messages = [{"role": "user", "content": "tell me about paris"}]
    chat = dict(model=SERVED_NAME, messages=messages, temperature=0, max_completion_tokens=16, logprobs=True)
    ref = chat_ids(client.chat.completions.create(**chat, extra_body=TOKEN_IDS).choices[0])
    i, word, banned = first_word(tokenizer, ref)
    out = chat_ids(client.chat.completions.create(**chat, extra_body={**TOKEN_IDS, "bad_words": [word]}).choices[0])
    assert out[:i] == ref[:i] and not banned & set(out)


def test_truncated_completion_and_chat_give_what_the_last_k_tokens_give(client, server, tokenizer):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": LONG_TEXT}).json()["tokens"]
    assert len(ids) > MAX_MODEL_LEN
    r = httpx.post(server.url + "/v1/completions", json={**GREEDY, "prompt": LONG_TEXT}, timeout=60)
    assert r.status_code == 400 and "maximum context length" in r.text  # without truncation
    direct = client.completions.create(**GREEDY, prompt=ids[-40:])
    cut = client.completions.create(**GREEDY, prompt=LONG_TEXT, extra_body={"truncate_prompt_tokens": 40})
    assert cut.choices[0].text == direct.choices[0].text and cut.usage.prompt_tokens == 40
    # echo returns the prompt the model saw: the kept tokens' text
    echoed = client.completions.create(**GREEDY, prompt=LONG_TEXT, echo=True, extra_body={"truncate_prompt_tokens": 40})
    assert echoed.choices[0].text == tokenizer.decode(ids[-40:]) + direct.choices[0].text

    messages = [{"role": "user", "content": LONG_TEXT[:700]}]
    rendered = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert len(rendered) > MAX_MODEL_LEN
    chat = dict(model=SERVED_NAME, messages=messages, temperature=0, max_completion_tokens=8)
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400
    cut = client.chat.completions.create(**chat, extra_body={"truncate_prompt_tokens": 60})
    direct = client.completions.create(model=SERVED_NAME, prompt=rendered[-60:], temperature=0, max_tokens=8)
    assert cut.choices[0].message.content == direct.choices[0].text and cut.usage.prompt_tokens == 60


def test_truncated_embeddings_embed_the_last_k_tokens(client, server):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": LONG_TEXT}).json()["tokens"]
    cut = client.embeddings.create(model=SERVED_NAME, input=[LONG_TEXT, PROMPT],
                                   extra_body={"truncate_prompt_tokens": 30})
    direct = [client.embeddings.create(model=SERVED_NAME, input=prompt) for prompt in (ids[-30:], PROMPT)]
    assert cut.usage.prompt_tokens == 30 + direct[1].usage.prompt_tokens  # (the short input is whole)
    for a, b in zip(cut.data, direct):
        assert np.allclose(a.embedding, b.data[0].embedding, atol=1e-6)
    whole = client.embeddings.create(model=SERVED_NAME, input=LONG_TEXT, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == MAX_MODEL_LEN  # (an embedding input may fill the context)
    full = client.embeddings.create(model=SERVED_NAME, input=LONG_TEXT,
                                    extra_body={"truncate_prompt_tokens": MAX_MODEL_LEN})
    assert full.data[0].embedding == whole.data[0].embedding


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": PROMPT, "bad_words": "fox"}, "bad_words", "bad_words"),
    ("/v1/completions", {"prompt": PROMPT, "bad_words": ["fox", 3]}, "bad_words[1]", "bad_words"),
    ("/v1/chat/completions", {"bad_words": [" "]}, "bad_words", "bad_words must be non-blank strings"),
    ("/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": "5"}, "truncate_prompt_tokens",
     "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
     "truncate_prompt_tokens must be an integer >= 1, or -1"),
    ("/v1/chat/completions", {"truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens",
     f"truncate_prompt_tokens value ({MAX_MODEL_LEN + 1}) is greater than max_model_len ({MAX_MODEL_LEN})"),
    ("/v1/embeddings", {"input": PROMPT, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens",
     "truncate_prompt_tokens must be an integer >= 1, or -1"),
    ("/v1/completions", {"prompt": LONG_TEXT, "truncate_prompt_tokens": MAX_MODEL_LEN}, "truncate_prompt_tokens",
     f"truncate_prompt_tokens={MAX_MODEL_LEN} keeps {MAX_MODEL_LEN} tokens but a prompt may have at most"),
])
def test_bad_values_are_400_naming_the_field(server, path, body, param, message):
    if path == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(server.url + path, json={"model": SERVED_NAME, **body}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and message in error["message"] and error["param"] == param, r.text


def test_max_tokens_past_the_context_is_a_400_naming_the_room_left(client, server):
    """As vLLM's server (and OpenAI's): prompt + max_tokens over max_model_len is refused, not silently cut;
    the error names the length field the request used."""
    import openai

    ids = list(range(100, 140))  # 40 prompt tokens
    room = MAX_MODEL_LEN - len(ids)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=room + 1)
    body = err.value.body
    assert body["param"] == "max_tokens", body
    assert f"max_tokens={room + 1} is too large" in body["message"] and f"at most {room}" in body["message"]
    ok = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=room, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == room and ok.choices[0].finish_reason == "length"
    chat = dict(model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=MAX_MODEL_LEN)
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and "is too large" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "max_completion_tokens", r.text  # (the field the request used)
    r = httpx.post(server.url + "/v1/responses", json={"model": SERVED_NAME, "input": "hi",
                                                       "max_output_tokens": MAX_MODEL_LEN}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens", r.text
    # without max_tokens a request generates up to the context's end, and the server keeps serving
    assert client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=2).usage.completion_tokens >= 1
