"""Engine-level: greedy generation with the cuda platform and the triton_paged backend is
token-identical to transformers (float32, tiny random checkpoints). Needs a GPU."""
from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.gpu

BLOCK = 16
BUDGET = 64  # the longest prompt is chunked: chunked prefill after cached blocks
NEW_TOKENS = 24


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("mistral", {"sliding_window": 48}), ("qwen3", {})])
def test_greedy_matches_transformers_on_cuda(arch, overrides, tmp_path):
    import torch
    from engine_helpers import hf_greedy, prompt_lengths
    from model_factory import make_checkpoint

    from halserve import LLM, SamplingParams

    if torch.version.hip:
        pytest.skip("the cuda platform; the rocm run uses platform='rocm' and triton_paged_rocm")
    # head_dim 64: the smallest head size triton_paged takes
    path = make_checkpoint(str(tmp_path), arch, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64,
                           **overrides)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in prompt_lengths(BLOCK, BUDGET)]
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    llm = LLM(path, platform="cuda", dtype="float32", block_size=BLOCK, max_num_batched_tokens=BUDGET,
              attention_backend="triton_paged")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (o, e) in enumerate(zip(outputs, expected)):
        assert o.outputs[0].token_ids == e, f"{arch}: prompt {i} (len {len(prompts[i])}) differs"


def test_speculative_decoding_on_cuda(tmp_path):
    """ngram drafts (and a draft model: the target itself) checked by the compiled triton_paged
    kernel: greedy-identical to transformers; the self-draft has every draft accepted."""
    import torch
    from engine_helpers import assert_speculation_matches, hf_greedy
    from model_factory import make_checkpoint

    if torch.version.hip:
        pytest.skip("the cuda platform")
    path = make_checkpoint(str(tmp_path), "llama", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64,
                           layer_scale=0.6)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 20, 40, 90)]
    assert_speculation_matches(path, prompts, hf_greedy(path, prompts, NEW_TOKENS), NEW_TOKENS, platform="cuda",
                               dtype="float32", block_size=BLOCK, max_num_batched_tokens=BUDGET,
                               attention_backend="triton_paged")
