"""Fixtures for server tests: a tiny checkpoint and the main test server (session-wide)."""
from __future__ import annotations

import pytest
from server_utils import VOCAB_SIZE, ServerProcess, server_args


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> str:
    from model_factory import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("tiny_llama")), "llama", vocab_size=VOCAB_SIZE)

@pytest.fixture(scope="session")
def server(checkpoint, tmp_path_factory):
    # (tool_choice 'auto' enabled here; the keyed server of test_server_auth runs without it)
    args = server_args(checkpoint, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    srv = ServerProcess(args, str(tmp_path_factory.mktemp("logs") / "server.log")).wait_ready()
    yield srv
    srv.stop()

# A Qwen3-like chat template: the prompt opens a think block unless ``enable_thinking`` is false
# (then it ends with an empty, closed one) or ``open_think`` is false (then the model may open
# one); an earlier assistant turn's reasoning_content is written back into its think block.
THINK_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message.get('reasoning_content') %}<think>{{ message['reasoning_content'] }}</think>{% endif %}"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif open_think is not defined or open_think %}<think>\n{% endif %}"
    "{% endif %}"
)


@pytest.fixture(scope="session")
def thinking_server(tmp_path_factory):
    """A thinking model's server (the reasoning, Responses and Messages tests): a tiny random
    checkpoint whose tokenizer has <think> and </think> as tokens, THINK_TEMPLATE, the qwen3
    reasoning parser and the hermes tool parser."""
    from model_factory import make_checkpoint

    root = tmp_path_factory.mktemp("thinking")
    path = make_checkpoint(str(root / "ckpt"), "llama", added_tokens=("<think>", "</think>"))
    template = root / "template.jinja"
    template.write_text(THINK_TEMPLATE, encoding="utf-8")
    args = server_args(path, "--reasoning-parser", "qwen3", "--chat-template", str(template),
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    srv = ServerProcess(args, str(root / "server.log")).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

@pytest.fixture(scope="session")
def async_client_factory(server):
    import openai

    def make():
        return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    return make
