"""Heads on the Transformers modeling backend for architectures with no native code: a
``*ForSequenceClassification`` checkpoint through LLM.classify against transformers' logits (a hybrid
sliding/full model among them), and embeddings of a fallback decoder through LLM.embed against
transformers' final hidden states, with chunked prefill and prefix-cache hits (float32, CPU)."""
from __future__ import annotations

import random

import pytest
import torch
from classifier_factory import hf_logits
from test_transformers_backend import BLOCK, FALLBACK, make_hf_checkpoint

from halserve import LLM, PoolingParams

ENGINE = dict(platform="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=BLOCK)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)  # (no pad token 0: transformers' head pools the last non-pad token)
    return [[1] + [rng.randrange(3, 500) for _ in range(n - 1)] for n in (1, 5, 2 * BLOCK + 7, 45)]


def _close(got: list[float], want: torch.Tensor) -> None:
    got_t = torch.tensor(got, dtype=torch.float32)
    assert got_t.shape == want.shape, (got_t.shape, want.shape)
    torch.testing.assert_close(got_t, want.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("name", "num_labels"), [pytest.param("olmo2", 1, marks=pytest.mark.slow), ("exaone4", 3)])
def test_classifier_without_native_code_matches_transformers(tmp_path, name, num_labels):
    from halserve.models import supported_architectures

    config_name, causal_arch, overrides = FALLBACK[name]
    arch = causal_arch.replace("ForCausalLM", "ForSequenceClassification")
    assert arch not in supported_architectures(), f"{arch} became native: pick another architecture"
    path = make_hf_checkpoint(tmp_path / name, config_name, arch, num_labels=num_labels, **overrides)
    reference = hf_logits(path)
    llm = LLM(path, **ENGINE)  # model_impl "auto": the fallback
    info = llm.llm_engine.model_info
    assert (info.model_impl, info.runner, info.num_labels) == ("transformers", "pooling", num_labels)
    prompts = _prompts(num_labels)
    params = [PoolingParams(), PoolingParams(activation=False)]
    outs = llm.classify([{"prompt_token_ids": p} for p in prompts for _ in params], params * len(prompts),
                        use_tqdm=False)
    for i, ids in enumerate(prompts):
        logits = reference(ids)
        _close(outs[2 * i].outputs.probs, logits.sigmoid() if num_labels == 1 else logits.softmax(-1))
        _close(outs[2 * i + 1].outputs.probs, logits)
    # a prompt sharing the long one's first two blocks starts from the prefix cache, with the same logits
    hits = llm.llm_engine.get_stats().prefix_cache_hits
    shared = prompts[2][:2 * BLOCK] + [7, 9, 11]
    (out,) = llm.classify({"prompt_token_ids": shared}, PoolingParams(activation=False), use_tqdm=False)
    assert llm.llm_engine.get_stats().prefix_cache_hits >= hits + 2 * BLOCK
    _close(out.outputs.probs, reference(shared))


def test_embeddings_of_a_fallback_decoder_match_transformers_hidden_states(tmp_path):
    from transformers import AutoModel

    config_name, arch, overrides = FALLBACK["olmo3"]  # (a sliding layer and a full one)
    path = make_hf_checkpoint(tmp_path / "olmo3", config_name, arch, **overrides)
    base = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, **ENGINE)
    assert llm.llm_engine.model_info.model_impl == "transformers"
    prompts = _prompts(5)
    pools = [PoolingParams(pooling_type="LAST", normalize=False), PoolingParams(pooling_type="MEAN"),
             PoolingParams(pooling_type="LAST")]
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts for _ in pools], pools * len(prompts), use_tqdm=False)
    for i, ids in enumerate(prompts):
        with torch.inference_mode():
            hidden = base(torch.tensor([ids])).last_hidden_state[0]  # [T, H], the final norm applied
        last, mean = hidden[-1], hidden.mean(0)
        _close(outs[3 * i].outputs.embedding, last)
        _close(outs[3 * i + 1].outputs.embedding, mean / mean.norm())
        _close(outs[3 * i + 2].outputs.embedding, last / last.norm())


@pytest.mark.slow  # (starts two servers)
def test_classify_and_embeddings_endpoints_serve_fallback_models(tmp_path):
    """``halserve serve`` on a classifier and on a decoder with no native code: POST /classify answers
    transformers' class probabilities, POST /v1/embeddings its normalized last hidden state."""
    import httpx
    from server_utils import ServerProcess
    from transformers import AutoModel, AutoTokenizer

    args = ["--platform", "cpu", "--max-model-len", "128", "--num-kv-blocks", "64", "--block-size", str(BLOCK),
            "--max-num-batched-tokens", str(BLOCK), "--log-level", "warning"]
    texts = ["hello world, tell me about the quick brown fox", "paris"]
    config_name, arch, overrides = FALLBACK["exaone4"]
    classifier = make_hf_checkpoint(tmp_path / "cls", config_name, arch.replace("ForCausalLM", "ForSequenceClassification"),
                                    num_labels=3, **overrides)
    decoder = make_hf_checkpoint(tmp_path / "dec", config_name, arch, **overrides)
    tokenize = AutoTokenizer.from_pretrained(decoder).encode

    srv = ServerProcess([classifier, "--served-model-name", "c", *args], str(tmp_path / "cls.log")).wait_ready()
    try:
        r = httpx.post(srv.url + "/classify", json={"model": "c", "input": texts}, timeout=60)
        models = httpx.get(srv.url + "/v1/models", timeout=30).json()
    finally:
        srv.stop()
    assert r.status_code == 200, r.text
    assert models["data"][0]["model_impl"] == "transformers"
    logits_of = hf_logits(classifier)
    for item, text in zip(r.json()["data"], texts):
        _close(item["probs"], logits_of(tokenize(text)).softmax(-1))

    srv = ServerProcess([decoder, "--served-model-name", "d", *args], str(tmp_path / "dec.log")).wait_ready()
    try:
        r = httpx.post(srv.url + "/v1/embeddings", json={"model": "d", "input": texts, "encoding_format": "float"},
                       timeout=60)
    finally:
        srv.stop()
    assert r.status_code == 200, r.text
    base = AutoModel.from_pretrained(decoder, dtype=torch.float32).eval()
    for item, text in zip(r.json()["data"], texts):
        with torch.inference_mode():
            last = base(torch.tensor([tokenize(text)])).last_hidden_state[0, -1]
        _close(item["embedding"], last / last.norm())
