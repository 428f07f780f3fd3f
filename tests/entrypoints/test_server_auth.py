"""--api-key: Bearer keys checked on the API, probes and scrapers stay open."""
from __future__ import annotations

import httpx
import openai
import pytest
from server_utils import SERVED_NAME, ServerProcess, server_args

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')


@pytest.fixture(scope="module")
def keyed_server(checkpoint, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("auth") / "server.log")
    srv = ServerProcess(server_args(checkpoint, "--api-key", "key-one", "key-two"), log).wait_ready()
    yield srv
    srv.stop()


def test_missing_or_wrong_key_is_401(keyed_server):
    url = keyed_server.url
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-one"}, {"Authorization": "Basic key-one"}):
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/tokenize")):
            r = httpx.request(method, url + path, json={"model": SERVED_NAME, "prompt": "a"}, headers=headers)
            assert r.status_code == 401, (headers, path)
            assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(url + path).status_code == 200


def test_auto_tool_choice_needs_a_parser(keyed_server):
    """This server runs without --enable-auto-tool-choice: tools with tool_choice 'auto' are a 400
    that says how to start the server, or what to send instead."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = httpx.post(keyed_server.url + "/v1/chat/completions", headers={"Authorization": "Bearer key-one"},
                   json={"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "--enable-auto-tool-choice --tool-call-parser" in message and "'required'" in message


def test_right_keys_work_after_rejections(keyed_server):
    for key in ("key-one", "key-two"):
        client = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=key, max_retries=0, timeout=60)
        out = client.completions.create(model=SERVED_NAME, prompt="hello", max_tokens=2, temperature=0)
        assert out.usage.completion_tokens >= 1
        assert [m.id for m in client.models.list().data] == [SERVED_NAME]
