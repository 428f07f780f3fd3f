"""``halserve serve --speculative-config``: the OpenAI routes through the official client give
what a server without speculation gives on the same checkpoint, streamed chunks may carry
several tokens and still add up, per-token logprobs line up, and /metrics counts the drafts.
The checkpoint's layers are scaled down so its greedy text repeats and drafts get accepted."""
from __future__ import annotations

import re

import httpx
import pytest
from server_utils import SERVED_NAME, VOCAB_SIZE, ServerProcess, server_args

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
PROMPTS = ["the quick brown fox jumps over the lazy dog and the quick brown", "hello hello hello", "paris is"]


@pytest.fixture(scope="module")
def repetitive_checkpoint(tmp_path_factory) -> str:
    from model_factory import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("repetitive")), "llama", vocab_size=VOCAB_SIZE, layer_scale=0.6)


@pytest.fixture(scope="module")
def servers(repetitive_checkpoint, tmp_path_factory):
    """(with speculation, without), started together."""
    logs = tmp_path_factory.mktemp("logs")
    pair = [ServerProcess(server_args(repetitive_checkpoint, *extra), str(logs / f"{name}.log"))
            for name, extra in (("spec", ("--speculative-config", SPEC)), ("plain", ()))]
    try:
        yield [srv.wait_ready() for srv in pair]
    finally:
        for srv in pair:
            srv.stop()


def _client(server: ServerProcess):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def spec_server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def spec_client(servers):
    return _client(servers[0])


@pytest.fixture(scope="module")
def client(servers):
    return _client(servers[1])


def _metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)}_total\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_completions_match_the_server_without_speculation(spec_server, spec_client, client):
    kwargs = dict(model=SERVED_NAME, prompt=PROMPTS, max_tokens=40, temperature=0.0, logprobs=2)
    want = client.completions.create(**kwargs)
    got = spec_client.completions.create(**kwargs)
    assert [c.text for c in got.choices] == [c.text for c in want.choices]
    assert [c.finish_reason for c in got.choices] == [c.finish_reason for c in want.choices]
    for g, w in zip(got.choices, want.choices):
        assert g.logprobs.tokens == w.logprobs.tokens
        assert g.logprobs.text_offset == w.logprobs.text_offset
        assert g.logprobs.token_logprobs == pytest.approx(w.logprobs.token_logprobs, abs=1e-4)
    assert got.usage.completion_tokens == want.usage.completion_tokens
    accepted = _metric(spec_server, "halserve:spec_decode_num_accepted_tokens")
    assert 0 < accepted <= _metric(spec_server, "halserve:spec_decode_num_draft_tokens")
    assert _metric(spec_server, "halserve:spec_decode_num_drafts") > 0


def test_streamed_chat_adds_up_to_the_unstreamed_answer(spec_client, client):
    messages = [{"role": "user", "content": "say hello hello hello"}]
    kwargs = dict(model=SERVED_NAME, messages=messages, max_tokens=48, temperature=0.7, seed=3)
    want = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = [c.choices[0].delta.content or "" for c in spec_client.chat.completions.create(stream=True, **kwargs)
              if c.choices]
    assert "".join(chunks) == want  # seeded: the same tokens with or without drafts
    whole = spec_client.chat.completions.create(**kwargs).choices[0].message.content
    assert whole == want


def test_stop_string_inside_accepted_drafts_cuts_there(spec_client, client):
    base = dict(model=SERVED_NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0.0)
    text = client.completions.create(**base).choices[0].text
    stop = text[10:14]  # a stop string a few tokens in (drafts of a repeating text cover it)
    assert stop.strip(), text
    want = client.completions.create(stop=[stop], **base).choices[0]
    got = spec_client.completions.create(stop=[stop], **base).choices[0]
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason) == (text[: text.index(stop)], "stop")


def test_streamed_completion_logprobs_cover_every_token(spec_client, client):
    """Chunks may bring several tokens at once (accepted drafts): their logprobs come with them."""
    kwargs = dict(model=SERVED_NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0.0, logprobs=1)
    want = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in spec_client.completions.create(stream=True, **kwargs) if c.choices]
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    assert tokens == want.logprobs.tokens
    assert "".join(c.text for c in chunks) == want.text
    assert any(c.logprobs and len(c.logprobs.tokens) > 1 for c in chunks)  # a multi-token step was streamed
