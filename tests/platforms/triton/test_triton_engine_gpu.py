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


def test_cuda_graphs_equal_enforce_eager(tmp_path):
    """Decode steps replayed from CUDA graphs (captured at start-up at padded batch sizes) give the
    tokens, token for token, and the logprobs of the same engine run with enforce_eager; requests end
    one by one, so the decode batch shrinks through padded sizes (7 -> 8, 5 -> 8, 3 -> 4, ...)."""
    import torch
    from model_factory import make_checkpoint

    from halserve import LLM, SamplingParams

    if torch.version.hip:
        pytest.skip("the cuda platform")
    path = make_checkpoint(str(tmp_path), "llama", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 17, 40, 90, 5, 33, 64)]
    max_tokens = [4, 30, 12, 24, 8, 18, 27]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3) for n in max_tokens]
    results = {}
    for eager in (False, True):
        llm = LLM(path, platform="cuda", dtype="float32", block_size=BLOCK, max_num_batched_tokens=BUDGET,
                  max_num_seqs=8, attention_backend="triton_paged", enforce_eager=eager)
        graphs = llm.llm_engine.core.executor.worker.model_runner.step_graphs
        assert (graphs is None) == eager
        replayed = []
        if graphs is not None:
            assert graphs.sizes == [1, 2, 4, 8] and type(graphs.capture).__name__ == "CudaGraphCapture"
            replay = graphs.replay

            def counting(*args, _replay=replay, **kwargs):
                hidden = _replay(*args, **kwargs)
                replayed.append(hidden is not None)
                return hidden

            graphs.replay = counting
        results[eager] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if not eager:
            assert sum(replayed) >= 10, f"{sum(replayed)} of {len(replayed)} steps replayed a graph"
        llm.llm_engine.shutdown()
        del llm
    for i, (g, e) in enumerate(zip(results[False], results[True])):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids, f"prompt {i} (len {len(prompts[i])}) differs"
        for a, b in zip(g.outputs[0].logprobs, e.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[k].logprob - b[k].logprob) < 1e-3 for k in a)
