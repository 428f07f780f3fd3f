"""POST /v1/embeddings through the official client: the final hidden state at each input's
last token (normalized), the same as transformers' and as the offline LLM.embed; other pooling
through --pooler-config (the engine side of pooling: tests/engine/test_pooling.py)."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from server_utils import SERVED_NAME, VOCAB_SIZE, ServerProcess, server_args

pytestmark = pytest.mark.slow  # starts servers (inner loop: -m 'not slow')

INPUTS = ["hello world, tell me about the quick brown fox", "paris"]


@pytest.fixture(scope="module")
def hidden_states(checkpoint):
    """transformers' final hidden states (after the final norm) [len, hidden] of each input."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModel.from_pretrained(checkpoint, dtype=torch.float32)

    def run(text: str) -> np.ndarray:
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            return model(ids).last_hidden_state[0].numpy()

    return {text: run(text) for text in INPUTS}


@pytest.fixture(scope="module")
def reference(hidden_states):
    """transformers' last hidden state (after the final norm) at each input's last token."""
    return {text: hidden[-1] for text, hidden in hidden_states.items()}


def test_embeddings_match_transformers(client, server, reference):
    # (the openai client asks for base64 and decodes it: float32, little-endian)
    out = client.embeddings.create(model=SERVED_NAME, input=INPUTS)
    assert [d.index for d in out.data] == [0, 1] and out.model == SERVED_NAME
    for text, item in zip(INPUTS, out.data):
        want = reference[text] / np.linalg.norm(reference[text])
        assert np.abs(np.asarray(item.embedding) - want).max() < 1e-5
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": INPUTS[0]}).json()["tokens"]
    assert out.usage.prompt_tokens == out.usage.total_tokens == len(tokens) + httpx.post(
        server.url + "/tokenize", json={"prompt": INPUTS[1]}).json()["count"]
    # as float lists, from token ids, unnormalized and cut to a few dimensions
    raw = httpx.post(server.url + "/v1/embeddings", json={"input": tokens, "encoding_format": "float"}).json()
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding"
    assert np.allclose(raw["data"][0]["embedding"], out.data[0].embedding, atol=1e-6)
    plain = httpx.post(server.url + "/v1/embeddings", json={"input": INPUTS[1], "normalize": False,
                                                            "dimensions": 8, "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(plain["data"][0]["embedding"]), dtype="<f4")
    assert vector.shape == (8,) and np.allclose(vector, reference[INPUTS[1]][:8], atol=1e-5)
    cut = client.embeddings.create(model=SERVED_NAME, input=INPUTS[1], dimensions=8).data[0].embedding
    assert len(cut) == 8 and abs(np.linalg.norm(cut) - 1) < 1e-5


@pytest.mark.parametrize("body, expected", [
    ({"input": ""}, "empty"),
    ({"input": []}, "input must not be empty"),
    ({"input": 5}, "input: must be a string"),
    ({"input": [1, VOCAB_SIZE]}, "out of range"),
    ({"input": "a", "dimensions": 0}, "dimensions must be a positive integer"),
    ({"input": "a", "dimensions": 10**6}, "exceeds the model's embedding size"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ({"input": [5] * 129}, "an embedding input may have at most max_model_len = 128"),
])
def test_bad_embedding_requests_are_400(server, body, expected):
    r = httpx.post(server.url + "/v1/embeddings", json={"model": SERVED_NAME, **body}, timeout=30)
    assert r.status_code == 400 and expected in r.json()["error"]["message"], r.text


def test_offline_embed_with_chunked_prefill_and_prefix_hits(checkpoint, reference):
    from halserve import LLM, PoolingParams

    llm = LLM(checkpoint, platform="cpu", dtype="float32", max_model_len=128, block_size=16,
              max_num_batched_tokens=16, enable_prefix_caching=True)
    long = INPUTS[0] * 3  # chunked over several steps; the second time it hits the prefix cache
    first, short = llm.embed([long, INPUTS[1]], use_tqdm=False)
    (again,) = llm.embed([long], use_tqdm=False)
    assert llm.llm_engine.get_stats().prefix_cache_hits > 0
    assert np.allclose(first.outputs.embedding, again.outputs.embedding, atol=1e-5)
    want = reference[INPUTS[1]] / np.linalg.norm(reference[INPUTS[1]])
    assert np.abs(np.asarray(short.outputs.embedding) - want).max() < 1e-5
    raw = llm.embed(INPUTS[1], PoolingParams(normalize=False), use_tqdm=False)[0]
    assert np.allclose(raw.outputs.embedding, reference[INPUTS[1]], atol=1e-5)
    # one PoolingParams per prompt, or a clear error for anything else
    cut, whole = llm.embed([INPUTS[1], INPUTS[1]], [PoolingParams(dimensions=4), PoolingParams()], use_tqdm=False)
    assert len(cut.outputs.embedding) == 4 and len(whole.outputs.embedding) == reference[INPUTS[1]].shape[0]
    with pytest.raises(ValueError, match="pooling_params must be a PoolingParams or a list of them"):
        llm.embed(INPUTS[1], {"dimensions": 4}, use_tqdm=False)
    # generation is unaffected in the same engine
    assert llm.generate("paris", use_tqdm=False)[0].outputs[0].token_ids


def test_pooler_config_flag_sets_pooling_and_normalize(checkpoint, tmp_path_factory, hidden_states):
    flag = '{"pooling_type": "MEAN", "normalize": false}'
    log = str(tmp_path_factory.mktemp("pooler") / "server.log")
    srv = ServerProcess(server_args(checkpoint, "--pooler-config", flag, "--max-num-batched-tokens", "8"),
                        log).wait_ready()
    try:
        url = srv.url + "/v1/embeddings"
        raw = httpx.post(url, json={"input": INPUTS, "encoding_format": "float"}, timeout=60).json()["data"]
        normalized = httpx.post(url, json={"input": INPUTS[0], "normalize": True}, timeout=60).json()["data"]
    finally:
        srv.stop()
    for text, item in zip(INPUTS, raw):  # (INPUTS[0] spans several 8-token chunks)
        assert np.abs(np.asarray(item["embedding"]) - hidden_states[text].mean(axis=0)).max() < 1e-5
    mean = hidden_states[INPUTS[0]].mean(axis=0)
    assert np.abs(np.asarray(normalized[0]["embedding"]) - mean / np.linalg.norm(mean)).max() < 1e-5


def test_unsupported_sentence_transformers_pooling_exits_2(checkpoint, tmp_path):
    import subprocess
    import sys

    from model_factory import with_sentence_transformers_config
    from server_utils import free_port

    path = with_sentence_transformers_config(checkpoint, tmp_path, "pooling_mode_weightedmean_tokens", True)
    proc = subprocess.run([sys.executable, "-m", "halserve.entrypoints.cli", "serve", path, "--platform", "cpu",
                           "--host", "127.0.0.1", "--port", str(free_port())], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert "pooling_mode_weightedmean_tokens" in error and "--pooler-config" in error, proc.stderr


def test_an_input_may_fill_the_context(server, checkpoint):
    # (nothing is generated: an embedding input of max_model_len tokens is served, as in vLLM)
    from transformers import AutoModel

    ids = [5 + (7 * i) % 300 for i in range(128)]
    body = {"model": SERVED_NAME, "input": ids, "encoding_format": "float", "normalize": False}
    r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 200, r.text
    model = AutoModel.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        want = model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
    assert np.abs(np.asarray(r.json()["data"][0]["embedding"]) - want).max() < 1e-4
    assert r.json()["usage"]["prompt_tokens"] == 128
