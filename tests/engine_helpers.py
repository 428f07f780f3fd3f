"""Helpers for engine tests: model families, prompt lengths, transformers' greedy output."""
from __future__ import annotations

import torch

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]

# Architecture-specific extras that make each family exercise its own code paths.
ARCH_OVERRIDES = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(sliding_window=48),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=32),
}


def prompt_lengths(block_size: int, max_num_batched_tokens: int) -> list[int]:
    """1 token; under one block; exactly one block; several blocks; longer than the
    per-step token budget (so prefill is chunked); and a few in between."""
    return [1, block_size - 3, block_size, 3 * block_size + 5, max_num_batched_tokens + 37, 7, 2 * block_size + 1, 23]


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding), eos disabled."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                min_new_tokens=0, pad_token_id=0,
            )
            outs.append(y[0, len(ids):].tolist())
    return outs


def assert_speculation_matches(path: str, prompts: list[list[int]], expected: list[list[int]], max_tokens: int,
                               **engine_kwargs) -> None:
    """Greedy generation with ngram drafts, then with a draft model (the target itself, so every
    draft is accepted), gives ``expected``; drafts were accepted (the checkpoint must repeat itself,
    e.g. ``make_checkpoint(..., layer_scale=0.6)``)."""
    from halserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1},
                 {"model": path, "num_speculative_tokens": 3}):
        llm = LLM(path, speculative_config=spec, **engine_kwargs)
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            stats = llm.llm_engine.core.get_stats()
        finally:
            llm.llm_engine.shutdown()
        assert [o.outputs[0].token_ids for o in outputs] == expected, spec
        assert stats.spec_num_accepted_tokens > 0, spec
        if "model" in spec:
            assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


def greedy_params(max_tokens: int, **extra):
    from halserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def generate_ids(llm, prompts: list[list[int]], params) -> list[list[int]]:
    """Every completion's token ids (each request's ``n`` of them in turn), prompts given as token ids."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def assert_greedy_matches_one_rank(path: str, prompts: list[list[int]], llm, max_tokens: int, label: str,
                                   **engine_kwargs) -> None:
    """``llm`` (several ranks) gives transformers' greedy tokens, as one rank does, prompt by prompt."""
    from halserve import LLM

    expected = hf_greedy(path, prompts, max_tokens)
    one_rank = LLM(path, **engine_kwargs)
    try:
        assert generate_ids(one_rank, prompts, greedy_params(max_tokens)) == expected
    finally:
        one_rank.llm_engine.shutdown()
    got = generate_ids(llm, prompts, greedy_params(max_tokens))
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{label} prompt {i} (len {len(prompts[i])}) differs from transformers"


def assert_seeded_sampling_is_reproducible(llm, prompts: list[list[int]]) -> None:
    """A seeded request gives the same tokens whatever the batch order (on several ranks: the ranks
    agree on every sampled token, which the executor checks each step); unseeded ones run too."""
    from halserve import SamplingParams

    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=8, ignore_eos=True)
    first = generate_ids(llm, prompts, params)
    assert first == generate_ids(llm, prompts[::-1], params)[::-1]
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    assert all(len(t) == 8 for t in generate_ids(llm, prompts, unseeded))
