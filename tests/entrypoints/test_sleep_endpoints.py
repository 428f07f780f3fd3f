"""vLLM's sleep-mode endpoints on ``halserve serve --enable-sleep-mode`` (the engine core in its own
process): /sleep, /wake_up, /is_sleeping, /reset_prefix_cache, /update_weights, /collective_rpc; a
completion while asleep is a 503 and the engine survives it; without the flag the routes do not exist
(404)."""
from __future__ import annotations

import math

import httpx
import pytest
import torch
from server_utils import SERVED_NAME, ServerProcess, server_args

from halserve.entrypoints.openai.errors import BadRequestError
from halserve.entrypoints.openai.serving_sleep import json_results


def _complete(url: str) -> httpx.Response:
    body = {"model": SERVED_NAME, "prompt": "hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def _text(url: str) -> str:
    response = _complete(url)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _rpc(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/collective_rpc", json=body, timeout=60)


def _rpc_error(url: str, **body) -> str:
    reply = _rpc(url, **body)
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]["message"]


@pytest.mark.slow  # starts a server (inner loop: -m 'not slow')
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

        # /collective_rpc: a worker method's result per rank, as JSON; the caller's mistakes are 400s naming them
        reply = _rpc(url, method="memory_in_use", args=[], kwargs={}, timeout=None)
        assert reply.status_code == 200, reply.text
        (rss,) = reply.json()["results"]
        assert isinstance(rss, int) and rss > 10 * 2**20  # (the engine core process's RSS, the uni executor's)
        (backend,) = _rpc(url, method="attention_backend_name").json()["results"]
        assert isinstance(backend, str) and backend
        assert "'no_such_method'" in _rpc_error(url, method="no_such_method")
        assert "memory_in_use" in _rpc_error(url, method="no_such_method")  # (the methods there are)
        assert "'_lora_manager' is private" in _rpc_error(url, method="_lora_manager")
        assert "use POST /sleep" in _rpc_error(url, method="sleep", args=[2])
        # (async scheduling's step halves: execute_model_deferred with a null step was a 500 whose
        # connection uvicorn dropped, and take_deferred_output could take the engine's own step's output)
        for method in ("execute_model_deferred", "take_deferred_output"):
            assert "driven by the engine itself" in _rpc_error(url, method=method, args=[None])
        assert "refused the arguments" in _rpc_error(url, method="memory_in_use", args=[1])
        assert "LoRA is not enabled" in _rpc_error(url, method="list_loras")  # (the worker's ValueError)
        assert "timeout" in _rpc_error(url, method="memory_in_use", timeout=5)
        assert _rpc(url, methods="memory_in_use").status_code == 400
        assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
        assert _text(url) == before  # none of it disturbed the engine

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


@pytest.mark.slow  # the session's server
def test_sleep_routes_do_not_exist_without_the_flag(server):
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                         ("POST", "/reset_prefix_cache"), ("POST", "/update_weights"), ("POST", "/collective_rpc")):
        assert httpx.request(method, server.url + path).status_code == 404, path


def test_collective_rpc_results_json_cannot_hold_are_named():
    results = [{"a": [1, 2.5, None, True, "x"], "b": (3, 4)}, None]
    assert json_results("m", results) is results
    for value, where, what in ((torch.zeros(2), "results[1]", "a torch.Tensor"),
                               ({"k": {1, 2}}, "results[1]['k']", "a builtins.set"),
                               ([math.nan], "results[1][0]", "the float nan"),
                               ({3: "x"}, "results[1] (a key)", "a builtins.int key 3")):
        with pytest.raises(BadRequestError) as info:
            json_results("kv_connector_info", [{}, value])
        message = info.value.message
        assert f"{where} is {what}," in message and "'kv_connector_info' ran" in message, message
        assert info.value.status_code == 400
