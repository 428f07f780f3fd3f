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
