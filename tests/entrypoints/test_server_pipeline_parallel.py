"""``halserve serve --pipeline-parallel-size 2``: two stages behind the OpenAI routes (the official
client) give what the one-rank session server gives on the same checkpoint, streamed or not."""
from __future__ import annotations

import pytest
from server_utils import SERVED_NAME, ServerProcess, server_args

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

PROMPTS = ["the quick brown fox", "hello", "paris is the capital of"]


def _client(server: ServerProcess):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def pp_server(checkpoint, tmp_path_factory):
    srv = ServerProcess(server_args(checkpoint, "--pipeline-parallel-size", "2"),
                        str(tmp_path_factory.mktemp("logs") / "pp.log"))
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_completions_and_chat_match_one_rank(server, pp_server):
    want_client, got_client = _client(server), _client(pp_server)
    kwargs = dict(model=SERVED_NAME, prompt=PROMPTS, max_tokens=16, temperature=0.0, logprobs=2)
    want, got = want_client.completions.create(**kwargs), got_client.completions.create(**kwargs)
    assert [c.text for c in got.choices] == [c.text for c in want.choices]
    for g, w in zip(got.choices, want.choices):
        assert g.logprobs.tokens == w.logprobs.tokens
        assert g.logprobs.token_logprobs == pytest.approx(w.logprobs.token_logprobs, abs=1e-4)
    messages = [{"role": "user", "content": "tell me about the sea"}]
    chat = dict(model=SERVED_NAME, messages=messages, max_tokens=12, temperature=0.0)
    want_text = want_client.chat.completions.create(**chat).choices[0].message.content
    stream = got_client.chat.completions.create(**chat, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == want_text
