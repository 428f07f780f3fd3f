"""Speculative decoding across two tensor-parallel ranks (the ``mp`` executor, gloo): the
drafts travel in the SchedulerOutput to both workers, which check them in lockstep."""
from __future__ import annotations

import random

import pytest

ENGINE_KWARGS = dict(platform="cpu", dtype="float32", block_size=8, max_num_batched_tokens=64,
                     num_kv_blocks=96, max_num_seqs=8)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _run(llm, prompts, params):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]


@pytest.mark.slow  # two spawned worker processes: ~15 s of CPU
def test_two_ranks_with_drafts_match_one_rank_without(tmp_path):
    from model_factory import make_checkpoint

    from halserve import LLM, SamplingParams

    path = make_checkpoint(str(tmp_path), "llama", num_layers=2, num_heads=4, num_kv_heads=2)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 6, 17, 40)]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=30, ignore_eos=True)]

    plain = LLM(path, **ENGINE_KWARGS)
    want = [_run(plain, prompts, p) for p in params]
    plain.llm_engine.shutdown()

    spec = LLM(path, tensor_parallel_size=2, speculative_config=SPEC, **ENGINE_KWARGS)
    try:
        got = [_run(spec, prompts, p) for p in params]
        stats = spec.llm_engine.core.get_stats()
    finally:
        spec.llm_engine.shutdown()
    assert got == want
    assert stats.spec_num_accepted_tokens > 0, "no draft was accepted: the test did not exercise speculation"
