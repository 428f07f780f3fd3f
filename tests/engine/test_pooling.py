"""Embedding pooling (LAST, MEAN, CLS) against transformers' final hidden states, across chunked
prefill, prefix caching and preemption; defaults from sentence-transformers files; overrides."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from halserve import LLM, PoolerConfig, PoolingParams

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

ENGINE = dict(platform="cpu", dtype="float32", block_size=16, max_model_len=256)


@pytest.fixture(scope="module")
def llama_path(checkpoint_factory):
    return checkpoint_factory("llama")


@pytest.fixture(scope="module")
def hidden_states(llama_path):
    """transformers' final hidden states (after the final norm) [len, hidden] of a token-id prompt."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(llama_path, dtype=torch.float32).eval()

    def get(ids: list[int]) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.tensor([ids])).last_hidden_state[0].numpy()

    return get


def expected(hidden: np.ndarray, pooling_type: str, normalize: bool) -> np.ndarray:
    vec = {"LAST": hidden[-1], "MEAN": hidden.mean(axis=0), "CLS": hidden[0]}[pooling_type]
    return vec / np.linalg.norm(vec) if normalize else vec


def assert_close(embedding: list[float], want: np.ndarray) -> None:
    got = np.asarray(embedding)
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max()), (
        np.abs(got - want).max())


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def test_mean_and_cls_match_transformers_over_chunks_and_cached_prefixes(llama_path, hidden_states):
    llm = LLM(llama_path, max_num_batched_tokens=32, pooler_config={"pooling_type": "MEAN"}, **ENGINE)
    assert llm.llm_engine.model_info.pooler_config == PoolerConfig(pooling_type="MEAN", normalize=True)
    rng = random.Random(0)
    shared = random_ids(rng, 64)  # 4 full blocks
    long, short = shared + random_ids(rng, 50), shared + random_ids(rng, 3)  # long: 4 chunks of <= 32 tokens
    stats = llm.llm_engine.get_stats
    llm.embed({"prompt_token_ids": long}, PoolingParams(pooling_type="LAST"), use_tqdm=False)  # caches `shared`
    hits = stats().prefix_cache_hits
    prompts = [{"prompt_token_ids": p} for p in (long, short, long, short)]
    params = [PoolingParams(), PoolingParams(), PoolingParams(pooling_type="CLS"),
              PoolingParams(pooling_type="CLS", normalize=False)]
    outs = llm.embed(prompts, params, use_tqdm=False)
    assert stats().prefix_cache_hits == hits, "MEAN/CLS requests must compute their whole prompt"
    for ids, out, (kind, norm) in zip((long, short, long, short), outs,
                                      [("MEAN", True), ("MEAN", True), ("CLS", True), ("CLS", False)]):
        assert_close(out.outputs.embedding, expected(hidden_states(ids), kind, norm))
    # the cache did hold the shared prefix: a LAST request uses it, with the same result as without
    (last,) = llm.embed({"prompt_token_ids": short}, PoolingParams(pooling_type="LAST"), use_tqdm=False)
    assert stats().prefix_cache_hits >= hits + 64
    assert_close(last.outputs.embedding, expected(hidden_states(short), "LAST", True))
    # Matryoshka cut of a mean
    (cut,) = llm.embed({"prompt_token_ids": long}, PoolingParams(dimensions=8), use_tqdm=False)
    want = hidden_states(long).mean(axis=0)[:8]
    assert_close(cut.outputs.embedding, want / np.linalg.norm(want))


def test_pooling_survives_preemption(llama_path, hidden_states, monkeypatch):
    """A tiny cache and growing generations preempt embedding requests mid-prefill; a restarted
    request pools its prompt from scratch (no rows counted twice, none missed)."""
    from halserve import SamplingParams
    from halserve.entrypoints.llm import embedding_params

    rng = random.Random(1)
    generations = [random_ids(rng, n) for n in (30, 20, 40)]
    prompts = [random_ids(rng, n) for n in (90, 120, 70, 100)]
    kinds = ["MEAN", "CLS", "LAST", "MEAN"]
    llm = LLM(llama_path, max_num_batched_tokens=48, num_kv_blocks=12, **ENGINE)
    scheduler = llm.llm_engine.core.scheduler
    preempted_mid_prefill = set()

    def preempt(request, original=scheduler._preempt):
        if request.sampling_params.pooling is not None and request.num_computed_tokens > 0:
            preempted_mid_prefill.add(request.request_id)
        original(request)

    monkeypatch.setattr(scheduler, "_preempt", preempt)
    params = ([SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)] * len(generations)
              + [embedding_params(PoolingParams(pooling_type=k, normalize=False)) for k in kinds])
    outs = llm.generate([{"prompt_token_ids": p} for p in generations + prompts], params, use_tqdm=False)
    assert preempted_mid_prefill, "the tiny cache should have preempted an embedding request mid-prefill"
    for ids, kind, out in zip(prompts, kinds, outs[len(generations):]):
        assert_close(out.embedding, expected(hidden_states(ids), kind, False))


@pytest.mark.parametrize("mode, normalize, kind", [
    ("pooling_mode_mean_tokens", False, "MEAN"),
    ("pooling_mode_cls_token", True, "CLS"),
])
def test_sentence_transformers_config_sets_the_defaults(llama_path, hidden_states, tmp_path, mode, normalize, kind):
    from model_factory import with_sentence_transformers_config

    path = with_sentence_transformers_config(llama_path, tmp_path, mode, normalize)
    llm = LLM(path, max_num_batched_tokens=32, **ENGINE)
    assert llm.llm_engine.model_info.pooler_config == PoolerConfig(pooling_type=kind, normalize=normalize)
    ids = random_ids(random.Random(2), 70)  # chunked
    params = [PoolingParams(), PoolingParams(normalize=not normalize)]  # a request's own normalize wins
    default, flipped = llm.embed([{"prompt_token_ids": ids}] * 2, params, use_tqdm=False)
    assert_close(default.outputs.embedding, expected(hidden_states(ids), kind, normalize))
    assert_close(flipped.outputs.embedding, expected(hidden_states(ids), kind, not normalize))


def test_pooler_config_overrides_the_checkpoint(llama_path, hidden_states, tmp_path):
    from model_factory import with_sentence_transformers_config

    ids = random_ids(random.Random(3), 40)
    st_mean = with_sentence_transformers_config(llama_path, tmp_path / "mean", "pooling_mode_mean_tokens", False)
    # only pooling_type overridden: normalize still comes from the checkpoint (no Normalize module)
    llm = LLM(st_mean, pooler_config=PoolerConfig(pooling_type="CLS"), **ENGINE)
    assert llm.llm_engine.model_info.pooler_config == PoolerConfig(pooling_type="CLS", normalize=False)
    assert_close(llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.embedding,
                 expected(hidden_states(ids), "CLS", False))
    # a mode halserve lacks (max) fails at load, naming it and the override ...
    st_max = with_sentence_transformers_config(llama_path, tmp_path / "max", "pooling_mode_max_tokens", True)
    with pytest.raises(ValueError, match=r"pooling_mode_max_tokens.*--pooler-config"):
        LLM(st_max, **ENGINE)
    # ... which makes it load (as JSON text, lower case accepted)
    llm = LLM(st_max, pooler_config='{"pooling_type": "mean"}', **ENGINE)
    assert llm.llm_engine.model_info.pooler_config == PoolerConfig(pooling_type="MEAN", normalize=True)
    assert_close(llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.embedding,
                 expected(hidden_states(ids), "MEAN", True))


@pytest.mark.parametrize("value, message", [
    ({"pooling_type": "MAX"}, "pooling_type must be one of LAST, MEAN, CLS, got 'MAX'"),
    ({"pooling_type": 3}, "pooling_type must be one of LAST, MEAN, CLS, got 3"),
    ({"normalize": "yes"}, "normalize must be true or false, got 'yes'"),
    ({"pooling": "MEAN"}, "pooler config has no field 'pooling'; its fields are pooling_type, normalize"),
    ("MEAN", "pooler config is not valid JSON"),
    (["MEAN"], "pooler config must be a dict"),
])
def test_bad_pooler_config_is_a_clear_error(llama_path, value, message):
    with pytest.raises(ValueError, match="pooler_config") as info:
        LLM(llama_path, pooler_config=value, **ENGINE)
    assert message in str(info.value)


def test_bad_pooling_type_in_request_params():
    assert PoolingParams(pooling_type="mean").pooling_type == "MEAN"  # any case, as --pooler-config
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN, CLS, got 'MAX'"):
        PoolingParams(pooling_type="max")
