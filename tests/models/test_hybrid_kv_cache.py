"""Sliding-window models over the per-group KV cache (halserve.kv_cache.spec), end to end against
transformers on tiny random fp32 checkpoints: Gemma-2-style (alternating), Gemma-3-style (3 sliding :
1 full) and Mistral-style (every layer slides). Prompts and generations run past the window, with
chunked prefill, prefix-cache hits and preemption; a sliding group holds only a window's blocks."""
from __future__ import annotations

import pytest
from engine_helpers import hf_greedy
from model_factory import make_checkpoint
from test_gemma import make_gemma_checkpoint

from halserve import LLM, SamplingParams
from halserve.kv_cache.spec import FullAttentionSpec, cdiv

BS = 4
WINDOW = 8


def gemma2(tmp_path):
    # 4 layers: sliding, full, sliding, full -> two groups of two layers
    return make_gemma_checkpoint(tmp_path, 2, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                 attn_logit_softcapping=20.0, final_logit_softcapping=30.0)


def gemma3(tmp_path):
    # 4 layers: 3 sliding, 1 full -> four groups of one layer
    return make_gemma_checkpoint(tmp_path, 3, num_hidden_layers=4, sliding_window=WINDOW,
                                 layer_types=["sliding_attention"] * 3 + ["full_attention"])


def mistral(tmp_path):
    return make_checkpoint(tmp_path, "mistral", sliding_window=WINDOW)  # every layer slides: one group


# name -> (checkpoint, KV-cache groups, num_kv_blocks: small enough that two requests' contexts do not fit)
MODELS = {"gemma2": (gemma2, 2, 36), "gemma3": (gemma3, 4, 56), "mistral": (mistral, 1, 12)}


def record_blocks(llm):
    """After each step: (running request -> tokens computed, blocks each group holds)."""
    sched = llm.llm_engine.core.scheduler
    update, seen = sched.update_from_output, []

    def recorded(so, out):
        result = update(so, out)
        seen.append(({r.request_id: r.num_computed_tokens for r in sched.running},
                     sched.kv_cache_manager.num_blocks_by_group()))
        return result

    sched.update_from_output = recorded
    return seen


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_matches_transformers_past_the_window(tmp_path, name):
    make, num_groups, num_blocks = MODELS[name]
    path = make(tmp_path)
    shared = [1, 45, 74, 299, 17, 273, 5, 88, 410, 9, 33, 61, 7, 190, 222, 3, 48, 91, 120, 77]
    prompts = [shared + [100 + i for i in range(17)], shared + [300, 301, 302], [1] + [200 + 3 * i for i in range(40)],
               shared[:9]]
    max_tokens = 28  # past the window, prompts too
    want = hf_greedy(path, prompts, max_new_tokens=max_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # chunked prefill (16-token steps), a pool too small for all of them (preemption)
    llm = LLM(path, platform="cpu", dtype="float32", block_size=BS, max_num_batched_tokens=16, num_kv_blocks=num_blocks,
              max_model_len=128)
    sched = llm.llm_engine.core.scheduler
    assert sched.kv_cache_manager.num_groups == num_groups
    seen = record_blocks(llm)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0, "the tiny cache should have forced preemption"
    assert stats.prefix_cache_hits > 0, "the shared prefix should hit the prefix cache"
    # every step: a full group holds its requests' whole context, a sliding one at most a window
    # plus a chunk per request (the blocks before the window were released)
    specs = sched.kv_cache_manager.specs
    for computed, by_group in seen:
        for spec, held in zip(specs, by_group):
            if isinstance(spec, FullAttentionSpec):
                assert held <= sum(cdiv(n + 1, BS) for n in computed.values())
            else:
                assert held <= len(computed) * (cdiv(WINDOW - 1 + 16, BS) + 1)
    # and again: the prompts now hit the prefix cache (whole windows of it), same tokens
    hits_before = stats.prefix_cache_hits
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want
    assert llm.llm_engine.get_stats().prefix_cache_hits > hits_before


def test_long_request_holds_a_window_not_its_length(tmp_path):
    """Gemma-3-style (3 sliding : 1 full): a 100-token prompt prefilled in one step holds 25 blocks per
    group; from the next step on, each sliding group gives back all but its window's blocks (the free
    count grows back) and holds a window while the full group grows with the context (hand counts)."""
    path = gemma3(tmp_path)
    prompt = [1] + [(7 * i) % 500 + 3 for i in range(99)]
    want = hf_greedy(path, [prompt], max_new_tokens=40)
    llm = LLM(path, platform="cpu", dtype="float32", block_size=BS, max_num_batched_tokens=128, max_model_len=256,
              num_kv_blocks=200)
    kv = llm.llm_engine.core.scheduler.kv_cache_manager
    seen = record_blocks(llm)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0]
    assert seen[0][1] == [25, 25, 25, 25]
    window_blocks = cdiv(WINDOW - 1, BS) + 1  # the positions the next query reads, over the block being filled
    assert seen[1][1] == [window_blocks] * 3 + [26]  # 3 x 22 blocks given back, one new per group
    for computed, by_group in seen[1:-1]:  # (after the last step the request is gone)
        (n,) = computed.values()
        # released before the step that computed token n - 1: blocks wholly before n - 1 - WINDOW + 1
        assert by_group == [cdiv(n, BS) - (n - WINDOW) // BS] * 3 + [cdiv(n, BS)], (n, by_group)
        assert by_group[0] <= window_blocks
    assert kv.get_num_free_blocks() == kv.num_usable_blocks


def test_gemma3_4k_prompt_512_window(tmp_path):
    """The issue's acceptance case: a 4096-token prompt through Gemma-3-style layers (3 sliding with a
    512-token window : 1 full), chunked in 512-token steps. At every step the blocks in use are at most
    the full layer's share plus a window's worth (and a chunk) per sliding group; greedy tokens match."""
    window, chunk, block_size = 512, 512, 16
    path = make_gemma_checkpoint(tmp_path, 3, num_hidden_layers=4, sliding_window=window,
                                 max_position_embeddings=4224, layer_types=["sliding_attention"] * 3 + ["full_attention"])
    prompt = [1] + [(37 * i) % 500 + 3 for i in range(4095)]
    want = hf_greedy(path, [prompt], max_new_tokens=8)
    llm = LLM(path, platform="cpu", dtype="float32", block_size=block_size, max_num_batched_tokens=chunk,
              max_model_len=4224, num_kv_blocks=1024)
    seen = record_blocks(llm)
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0]
    for computed, by_group in seen[:-1]:
        (n,) = computed.values()
        full_share = cdiv(n, block_size)
        assert by_group[-1] == full_share
        # the last step's chunk (<= 512 tokens) read from its first position - 511: a window plus a chunk
        assert all(held <= cdiv(window - 1 + chunk, block_size) + 1 for held in by_group[:-1]), (n, by_group)
        assert sum(by_group) <= full_share + 3 * (cdiv(window - 1 + chunk, block_size) + 1)
    # decoding: a window's blocks per sliding group
    assert all(held <= cdiv(window - 1, block_size) + 1 for held in seen[-2][1][:-1]), seen[-2]
