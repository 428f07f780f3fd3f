"""Greedy output is token-identical to transformers for each architecture, whatever the
engine's cache and batching settings (float32, CPU platform, random weights)."""
from __future__ import annotations

import random

import pytest
from engine_helpers import ARCHS, hf_greedy, prompt_lengths

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

BLOCK = 16
BUDGET = 64  # max_num_batched_tokens: the longest prompt is chunked over several steps
NEW_TOKENS = 32

VARIANTS = {
    "default": dict(),
    "no_prefix_cache": dict(enable_prefix_caching=False),
    "tiny_chunks": dict(max_num_batched_tokens=16),
    # 14 usable blocks (224 tokens) for 8 requests of up to ~133 tokens: forces preemption.
    "preempt": dict(num_kv_blocks=15),
    "one_seq": dict(max_num_seqs=1),
}


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, checkpoint_factory):
    arch = request.param
    path = checkpoint_factory(arch)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in prompt_lengths(BLOCK, BUDGET)]
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    return arch, path, prompts, expected


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(arch_case, variant):
    from halserve import LLM, SamplingParams

    arch, path, prompts, expected = arch_case
    kwargs = dict(platform="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=BUDGET)
    kwargs.update(VARIANTS[variant])
    llm = LLM(path, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{arch}/{variant}: prompt {i} (len {len(prompts[i])}) differs"
    if variant == "preempt":
        assert llm.llm_engine.get_stats().num_preemptions > 0, "the tiny cache should have forced preemption"
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * len(prompts)
