"""Bamba (Mamba2 + attention) natively, against transformers on a tiny random fp32 checkpoint: greedy
tokens with prompts split over several prefill chunks, preemption in a tiny KV pool and n > 1; the
Mamba2 states' blocks in the KV-cache usage (hand counts); abort frees them."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import hf_greedy
from model_factory import _randomize, make_tokenizer

from halserve import LLM, SamplingParams
from halserve.kv_cache.spec import MambaSpec, cdiv

# 4 layers: mamba, attention, mamba, mamba -> 4 groups of one layer (the attention group first).
# A state: conv [128 + 2 * 2 * 16, 3] + ssm [8, 16, 16] = 2624 elements; a page holds block_size * 2 * 2 * 16 of them
CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head="auto", mamba_n_groups=2,
              mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, max_position_embeddings=256)
STATE = MambaSpec((192, 3), (8, 16, 16), 64)
PROMPTS = [[1] + [(7 * i) % 500 + 3 for i in range(40)], [1, 45, 74, 299, 17], [1] + [200 + 3 * i for i in range(20)]]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    """(checkpoint path, transformers' greedy tokens for PROMPTS)."""
    from transformers import BambaConfig, BambaForCausalLM, GenerationConfig

    path = str(tmp_path_factory.mktemp("bamba"))
    torch.manual_seed(0)
    model = BambaForCausalLM(BambaConfig(**CONFIG)).to(torch.float32)
    _randomize(model, CONFIG["hidden_size"], seed=0)
    with torch.no_grad():  # decays and steps in a realistic range (random ones saturate the state)
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.log(torch.linspace(1, 4, param.numel())))
            elif name.endswith("dt_bias"):
                param.copy_(torch.linspace(-2, 0.5, param.numel()))
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(CONFIG["vocab_size"], 0, ()).save_pretrained(path)
    return path, hf_greedy(path, PROMPTS, max_new_tokens=MAX_TOKENS)


def record_steps(llm):
    """After each step: (running request -> tokens computed, blocks each group holds, kv usage)."""
    sched = llm.llm_engine.core.scheduler
    update, seen = sched.update_from_output, []

    def recorded(so, out):
        result = update(so, out)
        seen.append(({r.request_id: r.num_computed_tokens for r in sched.running},
                     sched.kv_cache_manager.num_blocks_by_group(), sched.kv_cache_usage))
        return result

    sched.update_from_output = recorded
    return seen


def test_greedy_matches_transformers_chunked_preempted_n2(bamba):
    """8-token prefill chunks (the 41-token prompt takes 6), 4-token blocks (11 per state, 33 per request
    for the three Mamba2 layers) in a pool of 90: the six samples (n=2) cannot all run, so some are
    preempted and recomputed from a fresh state; every sample is transformers' greedy continuation."""
    path, want = bamba
    llm = LLM(path, platform="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8, num_kv_blocks=90,
              max_model_len=128)
    kv = llm.llm_engine.core.scheduler.kv_cache_manager
    assert kv.num_groups == 4 and not kv.enable_prefix_caching
    assert [g.spec for g in kv.groups[1:]] == [STATE] * 3
    # (n > 1 must sample: top_k=1 samples the argmax, greedy's token)
    params = SamplingParams(n=2, temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[w[:12], w[:12]] for w in want]
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0, "the tiny pool should have forced preemption"
    assert stats.prefix_cache_hits == 0
    assert kv.get_num_free_blocks() == kv.num_usable_blocks


def test_kv_cache_usage_counts_the_states(bamba):
    """Each step, the attention group holds cdiv(computed, 16) blocks per running request and each Mamba2
    group one state (3 blocks of 16 tokens) per request; usage is their sum over the usable blocks."""
    path, want = bamba
    llm = LLM(path, platform="cpu", dtype="float32", block_size=16, max_num_batched_tokens=16, num_kv_blocks=64,
              max_model_len=128)
    kv = llm.llm_engine.core.scheduler.kv_cache_manager
    seen = record_steps(llm)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want[:2]
    assert STATE.num_state_blocks(16) == 3
    assert len(seen) > MAX_TOKENS
    for computed, by_group, usage in seen[:-1]:  # (after the last step every request is gone)
        attention = sum(cdiv(n, 16) for n in computed.values())
        assert by_group == [attention] + [3 * len(computed)] * 3, (computed, by_group)
        assert usage == pytest.approx((attention + 9 * len(computed)) / kv.num_usable_blocks)
    # abort mid-prefill: the request's state blocks go back with its attention blocks
    engine = llm.llm_engine
    engine.add_request("x", {"prompt_token_ids": PROMPTS[0]}, params)
    engine.step()
    assert kv.get_num_free_blocks() == kv.num_usable_blocks - 1 - 9
    engine.abort_request("x")
    engine.step()
    assert kv.get_num_free_blocks() == kv.num_usable_blocks


def test_speculative_decoding_is_refused(bamba):
    """A Mamba2 state cannot take back rejected drafts: the engine says so before serving."""
    path, _ = bamba
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    with pytest.raises(ValueError, match="recurrent .Mamba. layers"):
        LLM(path, platform="cpu", dtype="float32", block_size=16, max_model_len=128, speculative_config=spec)
