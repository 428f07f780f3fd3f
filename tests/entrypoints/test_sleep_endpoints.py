"""vLLM's sleep-mode endpoints on ``halserve serve --enable-sleep-mode`` (the engine core in its own
process): /sleep, /wake_up, /is_sleeping, /reset_prefix_cache, /update_weights; a completion while
asleep is a 503 and the engine survives it; without the flag the routes do not exist (404)."""
from __future__ import annotations

import httpx
import pytest
from server_utils import SERVED_NAME, ServerProcess, server_args

pytestmark = pytest.mark.slow  # starts a server (inner loop: -m 'not slow')


def _complete(url: str) -> httpx.Response:
    body = {"model": SERVED_NAME, "prompt": "hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def _text(url: str) -> str:
    response = _complete(url)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_sleep_endpoints_across_the_engine_core_process(checkpoint, tmp_path):
    from model_factory import make_checkpoint
    from server_utils import VOCAB_SIZE

    other = make_checkpoint(str(tmp_path / "other"), "llama", vocab_size=VOCAB_SIZE, seed=1)
    wider = make_checkpoint(str(tmp_path / "wider"), "llama", vocab_size=VOCAB_SIZE, hidden_size=128)
    srv = ServerProcess(server_args(checkpoint, "--enable-sleep-mode"), str(tmp_path / "server.log")).wait_ready()
    try:
        url = srv.url
        before = _text(url)
        assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}

        assert httpx.post(url + "/sleep", params={"level": 3}).status_code == 400
        assert httpx.post(url + "/sleep", params={"level": 2}).status_code == 200
        assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
        refused = _complete(url)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "engine_sleeping"
        assert "wake_up" in refused.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 200  # the engine survived it

        assert httpx.post(url + "/wake_up").status_code == 200
        assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
        assert _text(url) == before
        assert httpx.post(url + "/reset_prefix_cache").status_code == 200

        # weight updates: another checkpoint while asleep, then back while awake; a mismatch is a 400
        assert httpx.post(url + "/sleep", params={"level": 2}).status_code == 200
        assert httpx.post(url + "/update_weights", json={"path": other}, timeout=60).status_code == 200
        assert httpx.post(url + "/wake_up", timeout=60).status_code == 200
        assert _text(url) != before
        assert httpx.post(url + "/update_weights", json={"path": checkpoint}, timeout=60).status_code == 200
        assert _text(url) == before
        mismatch = httpx.post(url + "/update_weights", json={"path": wider}, timeout=60)
        assert mismatch.status_code == 400, mismatch.text
        assert "hidden_size 128 (served: 64)" in mismatch.json()["error"]["message"]
        assert httpx.post(url + "/update_weights", json={"paths": checkpoint}).status_code == 400
        assert _text(url) == before  # the old weights kept serving
    finally:
        srv.stop()


def test_sleep_routes_do_not_exist_without_the_flag(server):
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                         ("POST", "/reset_prefix_cache"), ("POST", "/update_weights")):
        assert httpx.request(method, server.url + path).status_code == 404, path
