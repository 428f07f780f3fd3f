"""Draft-model speculative decoding (``speculative_config={"model": ..., "num_speculative_tokens":
k}``): outputs equal those without speculation; a draft that is the target itself proposes
exactly the target's greedy tokens, so every draft is accepted -- which also checks that the
draft's K/V (written in the target's slots, reused through the prefix cache and rebuilt after
preemption) is right; a draft of another vocabulary size drafts among the shared ids; bad
drafts are refused with clear errors."""
from __future__ import annotations

import random

import pytest

from halserve import LLM, SamplingParams

KW = dict(platform="cpu", dtype="float32", max_model_len=96, block_size=8, max_num_batched_tokens=48, max_num_seqs=8)
LENGTHS = (1, 7, 8, 19, 40)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(target, a smaller draft of another family with the same tokenizer size)."""
    from model_factory import make_checkpoint

    root = tmp_path_factory.mktemp("draft_model")
    target = make_checkpoint(str(root / "target"), "llama", num_layers=2)
    draft = make_checkpoint(str(root / "draft"), "qwen2", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                            intermediate_size=64, seed=3)
    return target, draft


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]


def run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def spec_llm(target, draft, k, **kw):
    return LLM(target, speculative_config={"model": draft, "num_speculative_tokens": k}, **{**KW, **kw})


@pytest.fixture(scope="module")
def reference(ckpts, prompts):
    """Without speculation: greedy, and seeded sampling."""
    llm = LLM(ckpts[0], **KW)
    yield {name: run(llm, prompts, p) for name, p in PARAMS.items()}
    llm.llm_engine.shutdown()


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, top_k=50, seed=9, max_tokens=30, ignore_eos=True),
}


@pytest.mark.parametrize("k", [1, 4])
def test_the_target_as_its_own_draft_has_every_greedy_draft_accepted(ckpts, prompts, reference, k):
    target, _ = ckpts
    llm = spec_llm(target, target, k)
    try:
        assert run(llm, prompts, PARAMS["greedy"]) == reference["greedy"]
        stats = llm.llm_engine.core.get_stats()
        assert stats.spec_num_draft_tokens > 0
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
        assert stats.num_steps < 30 * 0.75  # k + 1 tokens per decode step, not one
        # again: the prompts now hit the prefix cache, whose blocks hold the draft's K/V too
        assert run(llm, prompts, PARAMS["greedy"]) == reference["greedy"]
        again = llm.llm_engine.core.get_stats()
        assert again.prefix_cache_hits > 0
        assert again.spec_num_accepted_tokens == again.spec_num_draft_tokens > stats.spec_num_draft_tokens
        # seeded sampling: the same tokens as without drafts (the drafts are the draft's greedy tokens)
        assert run(llm, prompts, PARAMS["seeded"]) == reference["seeded"]
    finally:
        llm.llm_engine.shutdown()


def test_another_draft_model_gives_the_same_outputs(ckpts, prompts, reference):
    target, draft = ckpts
    llm = spec_llm(target, draft, 3)
    try:
        for name, params in PARAMS.items():
            assert run(llm, prompts, params) == reference[name], name
        assert llm.llm_engine.core.get_stats().spec_num_draft_tokens > 0
    finally:
        llm.llm_engine.shutdown()


def test_preemption_and_max_model_len(ckpts, prompts, reference):
    """A cache of 26 blocks for 5 requests of up to 70 tokens: requests are preempted and
    recomputed (the draft's K/V with them); max_tokens=None runs each to max_model_len."""
    target, _ = ckpts
    plain = LLM(target, **{**KW, "num_kv_blocks": 26})
    to_the_end = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    want = run(plain, prompts, to_the_end)
    plain.llm_engine.shutdown()
    llm = spec_llm(target, target, 3, num_kv_blocks=26)
    try:
        assert run(llm, prompts, PARAMS["greedy"]) == reference["greedy"]
        got = run(llm, prompts, to_the_end)
        stats = llm.llm_engine.core.get_stats()
    finally:
        llm.llm_engine.shutdown()
    assert got == want and all(len(t) + n == KW["max_model_len"] for (t, _), n in zip(got, LENGTHS))
    assert stats.num_preemptions > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0


@pytest.mark.parametrize("vocab_size", [300, 700])
def test_a_draft_of_another_vocabulary_size_drafts_among_the_shared_ids(ckpts, prompts, reference, tmp_path,
                                                                        caplog, vocab_size):
    """(Qwen2.5-0.5B and -7B differ in padded vocabulary rows.) Drafts stay below both sizes."""
    import logging

    from model_factory import make_checkpoint

    target, _ = ckpts
    draft = make_checkpoint(str(tmp_path / f"v{vocab_size}"), "llama", vocab_size=vocab_size, num_layers=1)
    with caplog.at_level(logging.WARNING, logger="halserve"):
        llm = spec_llm(target, draft, 3)
    try:
        assert f"{vocab_size} vocabulary rows, the target 512" in caplog.text
        runner = llm.llm_engine.core.executor.worker.model_runner
        proposed, original = [], runner.drafter.propose

        def recording(*args):
            drafts = original(*args)
            proposed.extend(drafts)
            return drafts

        runner.drafter.propose = recording
        assert run(llm, prompts, PARAMS["greedy"]) == reference["greedy"]
        assert proposed and max(t for d in proposed for t in d) < min(vocab_size, 512)
    finally:
        llm.llm_engine.shutdown()


def test_bad_draft_models_are_refused(ckpts, tmp_path):
    target, _ = ckpts
    with pytest.raises(ValueError, match="draft model .*/nowhere"):
        spec_llm(target, str(tmp_path / "nowhere"), 2)
    with pytest.raises(ValueError, match='"draft_model" needs "model"'):
        LLM(target, speculative_config={"method": "draft_model", "num_speculative_tokens": 2}, **KW)


@pytest.mark.slow  # two spawned worker processes
def test_two_ranks(ckpts, prompts, reference):
    target, _ = ckpts
    llm = spec_llm(target, target, 3, tensor_parallel_size=2)
    try:
        assert run(llm, prompts, PARAMS["greedy"]) == reference["greedy"]
        stats = llm.llm_engine.core.get_stats()
    finally:
        llm.llm_engine.shutdown()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0


def test_the_draft_model_does_not_propose_for_batches_of_disable_by_batch_size(ckpts, prompts, reference):
    """Its drafts would be dropped: it proposes only once fewer than 3 requests are left."""
    llm = LLM(ckpts[0], speculative_config={"model": ckpts[0], "num_speculative_tokens": 2,
                                            "disable_by_batch_size": 3}, **KW)
    runner = llm.llm_engine.core.executor.worker.model_runner
    running_at_proposal = []
    propose = runner.drafter.propose

    def recording_propose(states, max_model_len):
        running_at_proposal.append(len(runner.requests))
        return propose(states, max_model_len)

    runner.drafter.propose = recording_propose
    lengths = [6 * (i + 1) for i in range(len(prompts))]  # (they finish one after another)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    try:
        got = [tokens for tokens, _ in run(llm, prompts, params)]
        stats = llm.llm_engine.core.get_stats()
    finally:
        llm.llm_engine.shutdown()
    assert got == [tokens[:n] for (tokens, _), n in zip(reference["greedy"], lengths)]
    assert running_at_proposal and max(running_at_proposal) < 3
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0  # (the target drafts for itself)
