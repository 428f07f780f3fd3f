"""The MoE, Gemma and Phi-3 families through the whole engine (LLM, CPU platform, native kernels):
greedy output token-identical to transformers under chunked prefill, preemption and prefix-cache
hits (float32, tiny random checkpoints written by transformers)."""
from __future__ import annotations

import random

import pytest
from engine_helpers import hf_greedy, prompt_lengths
from test_gemma import make_gemma_checkpoint
from test_moe import ARCHS as MOE_ARCHS
from test_moe import hf_config as moe_config
from test_phi3 import make_phi3

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

BLOCK = 16
BUDGET = 64
NEW_TOKENS = 24
VARIANTS = {
    "chunks_and_prefix_hits": dict(max_num_batched_tokens=16),
    # 12 usable blocks (192 tokens) for 12 requests of up to ~125 tokens: forces preemption
    "preempt": dict(num_kv_blocks=13),
}
# Gemma 2/3 mix sliding and full layers: one KV-cache group per layer here (3 layers), each pool block
# holds one layer, so the same memory as 12 whole-model blocks is 36 pool blocks (still forces preemption).
HYBRID_PREEMPT_BLOCKS = {"gemma2": 1 + 12 * 3, "gemma3": 1 + 12 * 3}


def _moe(tmp_dir, arch: str, **overrides) -> str:
    import torch
    import transformers
    from model_factory import _randomize, make_tokenizer
    from transformers import GenerationConfig

    config = moe_config(arch, **overrides)
    torch.manual_seed(0)
    model = getattr(transformers, MOE_ARCHS[arch][1])(config).to(torch.float32)
    _randomize(model, config.hidden_size, 0)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(str(tmp_dir), safe_serialization=True)
    make_tokenizer(config.vocab_size).save_pretrained(str(tmp_dir))
    return str(tmp_dir)


BUILDERS = {
    "mixtral": lambda d: _moe(d, "mixtral", sliding_window=40),
    "qwen2_moe": lambda d: _moe(d, "qwen2_moe", decoder_sparse_step=2),
    "gemma2": lambda d: make_gemma_checkpoint(d, 2, num_hidden_layers=3, sliding_window=24, query_pre_attn_scalar=24,
                                              attn_logit_softcapping=5.0, final_logit_softcapping=10.0),
    "gemma3": lambda d: make_gemma_checkpoint(d, 3, num_hidden_layers=3, sliding_window=24, sliding_window_pattern=2,
                                              query_pre_attn_scalar=24),
    "phi3": lambda d: make_phi3(d, max_position_embeddings=256, partial_rotary_factor=0.75, sliding_window=40),
}


@pytest.fixture(scope="module", params=list(BUILDERS))
def arch_case(request, tmp_path_factory):
    arch = request.param
    path = BUILDERS[arch](tmp_path_factory.mktemp(arch))
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in prompt_lengths(BLOCK, BUDGET)]
    shared = prompts[4][:3 * BLOCK + 5]  # (several full blocks: cached by the first request that has them)
    prompts += [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 0)]
    return arch, path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers_through_the_engine(arch_case, variant):
    from halserve import LLM, SamplingParams

    arch, path, prompts, expected = arch_case
    kwargs = dict(platform="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=BUDGET)
    extra = VARIANTS[variant]
    if variant == "preempt" and arch in HYBRID_PREEMPT_BLOCKS:
        extra = dict(num_kv_blocks=HYBRID_PREEMPT_BLOCKS[arch])
    llm = LLM(path, **(kwargs | extra))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for attempt in range(2):  # the second pass starts from the first's cached blocks
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for i, (out, want) in enumerate(zip(outputs, expected)):
            assert out.outputs[0].token_ids == want, f"{arch}/{variant} pass {attempt}: prompt {i} differs"
    stats = llm.llm_engine.get_stats()
    if variant == "preempt":
        assert stats.num_preemptions > 0, "the tiny cache should have forced preemption"
    else:
        assert stats.prefix_cache_hits > 0, "the shared prefix should have been served from the cache"
