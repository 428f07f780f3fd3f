"""LoRA adapters over HTTP: served by name (--lora-modules), listed in /v1/models after the base
model, loaded and unloaded at runtime (only with --allow-runtime-lora-updating), bad ones
refused with 400 while the server keeps serving. Outputs are checked against offline engines
on the merged checkpoints (base + scaling * B @ A)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest
from server_utils import MAX_MODEL_LEN, SERVED_NAME, ServerProcess, requests_finished_by, server_args

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

PROMPT = [17, 42, 99, 123, 7, 256, 300, 11, 5, 77, 401, 33]
MESSAGES = [{"role": "user", "content": "tell me about the quick brown fox"}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    from lora_factory import make_adapter

    mk = tmp_path_factory.mktemp
    return {
        "sql": make_adapter(mk("sql"), checkpoint, r=8, seed=11),
        "chat-lora": make_adapter(mk("chat_lora"), checkpoint, r=4, seed=12, target_modules=("q_proj", "v_proj")),
        "too-big": make_adapter(mk("too_big"), checkpoint, r=32, seed=13),
    }


@pytest.fixture(scope="module")
def expected(checkpoint, adapters, tmp_path_factory):
    """{model name: (completion text, chat text)} from offline engines on the merged checkpoints."""
    from lora_factory import merge_adapter

    from halserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    paths = {SERVED_NAME: checkpoint}
    for name in ("sql", "chat-lora"):
        paths[name] = merge_adapter(checkpoint, adapters[name], tmp_path_factory.mktemp(f"merged_{name}"))
    results = {}
    for name, path in paths.items():
        llm = LLM(path, platform="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)
        (completion,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
        (chat,) = llm.chat(MESSAGES, params, use_tqdm=False)
        results[name] = (completion.outputs[0].text, chat.outputs[0].text)
        llm.llm_engine.shutdown()
    assert len({text for text, _ in results.values()}) == 3  # each adapter changes the output
    return results


@pytest.fixture(scope="module")
def lora_server(checkpoint, adapters, tmp_path_factory):
    chat_lora = json.dumps({"name": "chat-lora", "path": adapters["chat-lora"], "base_model_name": SERVED_NAME})
    args = server_args(checkpoint, "--enable-lora", "--lora-modules", f"sql={adapters['sql']}", chat_lora,
                       "--max-loras", "2", "--max-lora-rank", "16", "--allow-runtime-lora-updating")
    srv = ServerProcess(args, str(tmp_path_factory.mktemp("logs") / "lora_server.log")).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def lora_client(lora_server):
    return openai.OpenAI(base_url=lora_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _complete(client, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def _chat(client, model: str) -> str:
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})
    return out.choices[0].message.content


def test_models_lists_each_adapter_after_the_base_model(lora_client, adapters):
    models = lora_client.models.list().data
    assert [m.id for m in models] == [SERVED_NAME, "sql", "chat-lora"]
    assert models[0].parent is None
    assert [(m.parent, m.root) for m in models[1:]] == [(SERVED_NAME, adapters["sql"]),
                                                       (SERVED_NAME, adapters["chat-lora"])]
    assert lora_client.models.retrieve("sql").root == adapters["sql"]


def test_requests_select_the_adapter_by_model_name(lora_client, expected):
    for name in (SERVED_NAME, "sql", "chat-lora"):
        assert _complete(lora_client, name) == expected[name][0], name
        assert _chat(lora_client, name) == expected[name][1], name


def test_unknown_model_is_404(lora_client):
    with pytest.raises(openai.NotFoundError) as info:
        _complete(lora_client, "no-such-adapter")
    assert "sql" in str(info.value) and "chat-lora" in str(info.value)  # the message lists what is served


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_load_and_unload_at_runtime(lora_server, lora_client, adapters, expected):
    load = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "dyn", "lora_path": adapters["chat-lora"]})
    assert load.status_code == 200 and "Success" in load.text
    assert "dyn" in [m.id for m in lora_client.models.list().data]
    assert _complete(lora_client, "dyn") == expected["chat-lora"][0]

    again = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "dyn", "lora_path": adapters["sql"]})
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    inplace = _post(lora_server, "/v1/load_lora_adapter",
                    {"lora_name": "dyn", "lora_path": adapters["sql"], "load_inplace": True})
    assert inplace.status_code == 200
    assert _complete(lora_client, "dyn") == expected["sql"][0]

    unload = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "dyn"})
    assert unload.status_code == 200 and "Success" in unload.text
    assert "dyn" not in [m.id for m in lora_client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        _complete(lora_client, "dyn")
    gone = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "dyn"})
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]


@pytest.mark.parametrize("body, status, fragment", [
    ({"lora_name": "big", "lora_path": "TOO_BIG"}, 400, "r=32 exceeds max_lora_rank=16"),
    ({"lora_name": "nowhere", "lora_path": "/no/such/adapter"}, 400, "not a directory"),
    ({"lora_name": "half"}, 400, "lora_path"),
    ({"lora_name": SERVED_NAME, "lora_path": "TOO_BIG"}, 400, "base model's name"),
])
def test_bad_loads_are_400_and_the_server_keeps_serving(lora_server, lora_client, adapters, expected, body, status,
                                                        fragment):
    body = {k: adapters["too-big"] if v == "TOO_BIG" else v for k, v in body.items()}
    response = _post(lora_server, "/v1/load_lora_adapter", body)
    assert response.status_code == status
    assert fragment in response.json()["error"]["message"]
    assert [m.id for m in lora_client.models.list().data] == [SERVED_NAME, "sql", "chat-lora"]
    assert _complete(lora_client, "sql") == expected["sql"][0]


def test_runtime_updates_are_off_by_default(server):
    """The session's main server runs without LoRA flags: the endpoints answer a clear 404."""
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "x"})):
        response = _post(server, path, body)
        assert response.status_code == 404
        assert "--allow-runtime-lora-updating" in response.json()["error"]["message"]


def test_vllm_env_var_allows_runtime_updates(monkeypatch):
    from halserve.entrypoints.cli import build_parser
    from halserve.entrypoints.cli_serve import load_lora_modules

    class Client:  # (the engine core's client: load_lora_modules calls the core through it)
        def call_sync(self, method, *args):
            assert method == "add_lora"

    class Engine:
        client = Client()

    def modules(flags, env):
        monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
        if env is not None:
            monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", env)
        args = build_parser().parse_args(["serve", "m", *flags])
        return load_lora_modules(args, Engine(), ["m"]).allow_runtime_updates

    assert modules(["--enable-lora"], None) is False
    assert modules(["--enable-lora"], "True") is True
    assert modules(["--enable-lora"], "0") is False
    assert modules(["--enable-lora", "--allow-runtime-lora-updating"], None) is True


def _serve_fails(*args: str) -> tuple[int, str]:
    from server_utils import free_port

    cmd = [sys.executable, "-m", "halserve.entrypoints.cli", "serve", *args, "--host", "127.0.0.1",
           "--port", str(free_port())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "HALSERVE_CPU_THREADS": "1"})
    return proc.returncode, proc.stdout + proc.stderr


def test_startup_refuses_bad_lora_flags(checkpoint, adapters):
    rc, out = _serve_fails(checkpoint, "--platform", "cpu", "--lora-modules", f"sql={adapters['sql']}")
    assert rc == 2 and "--lora-modules needs --enable-lora" in out
    rc, out = _serve_fails(checkpoint, "--platform", "cpu", "--enable-lora", "--lora-modules", "no-equals-sign")
    assert rc == 2 and "use name=path" in out
    rc, out = _serve_fails(*server_args(checkpoint, "--enable-lora", "--lora-modules", f"big={adapters['too-big']}"))
    assert rc == 2 and "LoRA adapter 'big'" in out and "--max-lora-rank 32" in out, out


def test_beam_search_runs_on_the_named_adapter(lora_client, expected):
    # beam width 1 is greedy decoding: with an adapter's name, the adapter's greedy text
    for name in (SERVED_NAME, "sql"):
        out = lora_client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, n=1,
                                             extra_body={"use_beam_search": True, "ignore_eos": True})
        assert out.choices[0].text == expected[name][0], name


def test_runtime_adapters_are_served_by_every_api_server(checkpoint, adapters, expected, tmp_path):
    """--api-server-count 2: an adapter loaded at runtime through whichever server answers is served
    by both (the engine-core process keeps the names), two adapters loaded one after the other get
    their own ids (each answers with its own weights), and an unload removes it from both."""
    args = server_args(checkpoint, "--api-server-count", "2", "--enable-lora", "--lora-modules",
                       f"sql={adapters['sql']}", "--max-loras", "2", "--max-lora-rank", "16",
                       "--allow-runtime-lora-updating")
    srv = ServerProcess(args, str(tmp_path / "lora_two_servers.log")).wait_ready()

    def fresh(method: str, path: str, **kwargs) -> httpx.Response:  # (a new connection: either server answers)
        return httpx.request(method, srv.url + path, headers={"Connection": "close"}, timeout=60, **kwargs)

    def complete(model: str) -> httpx.Response:
        return fresh("POST", "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0, "ignore_eos": True})

    try:
        for name, path in (("dyn-a", adapters["chat-lora"]), ("dyn-b", adapters["sql"])):
            load = fresh("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
            assert load.status_code == 200, load.text
        for _ in range(8):  # (the kernel spreads new connections over the two servers)
            assert [m["id"] for m in fresh("GET", "/v1/models").json()["data"]] == [SERVED_NAME, "sql", "dyn-a",
                                                                                   "dyn-b"]
            assert complete("dyn-a").json()["choices"][0]["text"] == expected["chat-lora"][0]
            assert complete("dyn-b").json()["choices"][0]["text"] == expected["sql"][0]
            assert complete("sql").json()["choices"][0]["text"] == expected["sql"][0]
        assert fresh("POST", "/v1/unload_lora_adapter", json={"lora_name": "dyn-a"}).status_code == 200
        for _ in range(8):
            response = complete("dyn-a")
            assert response.status_code == 404 and "does not exist" in response.json()["error"]["message"]
            assert fresh("POST", "/v1/unload_lora_adapter", json={"lora_name": "dyn-a"}).status_code == 404
        import psutil

        api_servers = [c for c in psutil.Process(srv.proc.pid).children()
                       if "spawn_main" in " ".join(c.cmdline()) and not any(
                           s.laddr.endswith("core.sock") for s in c.net_connections(kind="unix"))]
        served = [requests_finished_by(p) for p in api_servers]
        assert len(served) == 2 and all(served), served  # (both servers answered adapter requests)
    finally:
        assert srv.stop() == 0
