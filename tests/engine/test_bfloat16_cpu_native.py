"""bfloat16 on the CPU platform: the default attention backend is then cpu_native (native
bf16 kernels, float32 arithmetic inside) and its greedy output equals the torch reference
backend's in bf16, prompts long enough to take the native prefill, chunked prefill and
decode paths."""
from __future__ import annotations

import random

import pytest

from halserve.platforms import cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels.toolchain_missing() is not None, reason=f"no C++ toolchain: {cpu_kernels.toolchain_missing()}"
)
pytestmark = [pytestmark, pytest.mark.slow]  # starts engines (inner loop: -m 'not slow')

BLOCK = 16
NEW_TOKENS = 16
PROMPT_LENGTHS = [5, 16, 23, 40, 71]


# bf16 rounds differently in the two backends (the torch one computes attention in bf16, the
# native kernels in float32), so where the reference's top two tokens are this close in
# log-probability the argmax may flip; the texts are compared up to such a near-tie.
NEAR_TIE = 0.05


def _greedy(path, prompts, dtype="bfloat16", **kwargs):
    from halserve import LLM, SamplingParams

    # A 64-token budget chunks the 71-token prompt: its second chunk reads cached context.
    llm = LLM(path, platform="cpu", dtype=dtype, block_size=BLOCK, max_num_batched_tokens=64, **kwargs)
    backend = llm.llm_engine.core.executor.collective_rpc("attention_backend_name")[0]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return backend, [o.outputs[0] for o in outputs]


def _prompts(path):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def test_bfloat16_greedy_matches_torch_backend(checkpoint_factory):
    path = checkpoint_factory("llama")
    prompts = _prompts(path)
    backend, got = _greedy(path, prompts)
    assert backend == "cpu_native"
    ref_backend, want = _greedy(path, prompts, attention_backend="torch")
    assert ref_backend == "torch"
    _assert_equal_up_to_near_ties(got, want)


@pytest.mark.parametrize("cache", ["bfloat16", "float16"])
def test_a_16_bit_kv_cache_under_float32_matches_torch_backend(checkpoint_factory, caplog, cache):
    """kv_cache_dtype="bfloat16" / "float16" under a float32 model (float16: llama.cpp's default cache, and the
    GGUF models' default): the cache is allocated in that type, and cpu_native's greedy output equals the torch
    backend's on its own cache of that type (both store the same rounded K/V and compute in float32)."""
    import logging

    path = checkpoint_factory("llama")
    prompts = _prompts(path)
    with caplog.at_level(logging.INFO, logger="halserve"):
        backend, got = _greedy(path, prompts, dtype="float32", kv_cache_dtype=cache)
    assert backend == "cpu_native"
    assert any("KV cache" in r.getMessage() and f"torch.{cache}" in r.getMessage() for r in caplog.records)
    ref_backend, want = _greedy(path, prompts, dtype="float32", kv_cache_dtype=cache, attention_backend="torch")
    assert ref_backend == "torch"
    _assert_equal_up_to_near_ties(got, want)


def _assert_equal_up_to_near_ties(got, want):
    num_equal = 0
    for i, (g, w) in enumerate(zip(got, want)):
        same = 0
        while same < NEW_TOKENS and g.token_ids[same] == w.token_ids[same]:
            same += 1
        num_equal += same
        if same < NEW_TOKENS:  # only at a near-tie of the reference, between its top two
            top = w.logprobs[same]
            picked = g.token_ids[same]
            assert picked in top, f"prompt {i}: token {same} is {picked}, not in the reference's top 2 {top}"
            gap = top[w.token_ids[same]].logprob - top[picked].logprob
            assert gap < NEAR_TIE, f"prompt {i}: token {same} differs where the reference's margin is {gap:.3f}"
    assert num_equal >= 0.75 * NEW_TOKENS * len(want), f"only {num_equal} tokens agree"
