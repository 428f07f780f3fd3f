"""Disaggregated prefill over HTTP: a prefill server (``kv_producer``) and a decode server
(``kv_consumer``), sharing a storage directory or pulling over TCP (``P2pConnector``), behind
``halserve proxy``, spoken to with the official ``openai`` client. The decode server must load the
prompt's K/V (its usage reports the cached tokens) and answer what a plain server answers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from server_utils import SERVED_NAME, ServerProcess, free_port, server_args

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

PROMPT = [(11 * j) % 500 + 3 for j in range(70)]  # 4 full blocks of 16, and 6 tokens


def connector_configs(kind, store):
    """(the prefill server's --kv-transfer-config, the decode server's)."""
    if kind == "storage":
        return tuple(json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": role,
                                 "kv_connector_extra_config": {"shared_storage_path": str(store)}})
                     for role in ("kv_producer", "kv_consumer"))
    port = free_port()
    return (json.dumps({"kv_connector": "P2pConnector", "kv_role": "kv_producer", "kv_port": port,
                        "kv_connector_extra_config": {"num_cpu_blocks": 256}}),
            json.dumps({"kv_connector": "P2pConnector", "kv_role": "kv_consumer",
                        "kv_connector_extra_config": {"peer": f"127.0.0.1:{port}"}}))


@pytest.fixture(scope="module", params=["storage", "p2p"])
def deployment(request, tiny_llama, tmp_path_factory):
    """(connector kind, proxy url, prefill server, decode server, storage dir)."""
    logs, store = tmp_path_factory.mktemp("pd_logs"), tmp_path_factory.mktemp("pd_store")
    prefill_config, decode_config = connector_configs(request.param, store)
    servers = [
        ServerProcess(server_args(tiny_llama, "--kv-transfer-config", prefill_config), str(logs / "prefill.log")),
        ServerProcess(server_args(tiny_llama, "--kv-transfer-config", decode_config,
                                  "--enable-prompt-tokens-details"), str(logs / "decode.log")),
    ]
    proxy = None
    try:
        prefill, decode = (srv.wait_ready() for srv in servers)
        port = free_port()
        proxy = subprocess.Popen(
            [sys.executable, "-m", "halserve.entrypoints.cli", "proxy", "--prefill", prefill.url, "--decode",
             decode.url, "--port", str(port), "--log-level", "warning"],
            stdout=open(logs / "proxy.log", "wb"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proxy.poll() is None and time.monotonic() < deadline, (logs / "proxy.log").read_text()
            time.sleep(0.2)
        yield request.param, url, prefill, decode, store
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        for srv in servers:
            srv.stop()


def client(url):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_decode_server_loads_what_the_prefill_server_computed(deployment):
    kind, url, prefill, decode, store = deployment
    direct = client(prefill.url).completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    files_before = {f for _, _, fs in os.walk(store) for f in fs}
    reply = client(url).completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    assert reply.choices[0].text == direct.choices[0].text and reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens_details.cached_tokens == 64  # the decode server loaded 4 blocks
    if kind == "storage":
        assert {f for _, _, fs in os.walk(store) for f in fs} == files_before  # (the direct request saved them)

    other = [(13 * j) % 500 + 5 for j in range(40)]  # new to both: the proxy's prefill step saves it
    streamed = client(url).completions.create(model=SERVED_NAME, prompt=other, max_tokens=6, temperature=0,
                                              stream=True)
    text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    plain = client(prefill.url).completions.create(model=SERVED_NAME, prompt=other, max_tokens=6, temperature=0)
    assert text == plain.choices[0].text
    if kind == "storage":
        assert len({f for _, _, fs in os.walk(store) for f in fs}) == len(files_before) + 2
    metrics = httpx.get(decode.url + "/metrics").text
    loaded = [line for line in metrics.splitlines() if line.startswith("halserve:kv_connector_hit_tokens_total")]
    assert loaded and float(loaded[0].split()[-1]) >= 64
    models = client(url).models.list()
    assert [m.id for m in models.data] == [SERVED_NAME]


def test_errors_pass_through_the_proxy(deployment):
    import openai

    _, url, *_ = deployment
    with pytest.raises(openai.BadRequestError) as info:
        client(url).completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=8, temperature=-1)
    assert "temperature" in str(info.value)
    with pytest.raises(openai.NotFoundError):
        client(url).completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    reply = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "not JSON" in reply.json()["error"]["message"]


def test_unreachable_server_is_a_502_naming_it():
    from fastapi.testclient import TestClient

    from halserve.entrypoints.disagg_proxy import build_proxy_app

    dead = f"http://127.0.0.1:{free_port()}"
    with TestClient(build_proxy_app([dead], [dead], timeout=5)) as http:
        reply = http.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert reply.status_code == 502 and f"prefill server {dead} unreachable" in reply.json()["error"]["message"]
        assert http.get("/health").status_code == 503


def test_serve_refuses_a_bad_connector_before_loading(tiny_llama):
    result = subprocess.run(
        [sys.executable, "-m", "halserve.entrypoints.cli", "serve", *server_args(tiny_llama),
         "--kv-transfer-config", '{"kv_connector": "SharedStorageConnector"}'],
        capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert 'SharedStorageConnector needs kv_connector_extra_config "shared_storage_path"' in result.stderr
