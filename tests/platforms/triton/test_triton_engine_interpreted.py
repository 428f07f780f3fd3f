"""Engine-level, without a GPU: the cuda (and rocm) platform's whole stack (the triton_paged
backend and the Triton RMSNorm / rotary / SiLU-and-mul kernels the plugin registers, resolved
by the model's layers as on a GPU) runs inside the engine through the Triton interpreter, and
greedy output is token-identical to transformers.

The platform is patched to put its tensors on the CPU (``device_type = "cpu"``) and to probe
available; everything above the device (kernel resolution, backend selection, cache dtype and
layout, metadata, the scheduler's mixed prefill/decode steps with chunking and prefix hits)
is the GPU code path. On a GPU, ``test_triton_engine_gpu.py`` runs the real thing.
"""
from __future__ import annotations

import logging
import random

import pytest
import torch

# (not `from conftest import HAS_GPU`: which conftest that names depends on what else is collected)
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a GPU is present: test_triton_engine_gpu.py runs the cuda platform compiled instead"
)
pytestmark = [pytestmark, pytest.mark.slow, pytest.mark.extended]  # whole engines through the Triton interpreter, minutes (inner loop: -m 'not slow')

BLOCK = 16
BUDGET = 64  # the longest prompt is chunked over several steps
NEW_TOKENS = 12

CASES = {
    # arch: (checkpoint overrides, engine overrides)
    "llama": (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), {}),
    "mistral": (dict(sliding_window=48), {}),
    # the platform picks the backend: flash_attn (fp16/bf16 only) is skipped, with the reason logged
    "qwen2": (dict(tie_word_embeddings=True), dict(block_size=32, attention_backend=None)),
    "qwen3": ({}, dict(block_size=64)),
}


def _interpret_on_cpu(monkeypatch, platform_cls, **extra):
    """Move a torch.cuda-API platform's device handling to the CPU (see the module docstring)."""
    from halserve.platforms.base import ProbeResult

    monkeypatch.setattr(platform_cls, "_probe", classmethod(lambda cls: ProbeResult(True, "interpreted on CPU")))
    monkeypatch.setattr(platform_cls, "device_type", "cpu")
    monkeypatch.setattr(platform_cls, "memory_info", lambda self, index=0: (1 << 30, 2 << 30))
    for name in ("set_device", "synchronize", "empty_cache"):
        monkeypatch.setattr(platform_cls, name, lambda self, *args: None)
    monkeypatch.setattr(platform_cls, "seed_everything", lambda self, seed: torch.manual_seed(seed))
    for name, value in extra.items():
        monkeypatch.setattr(platform_cls, name, value)


@pytest.fixture
def interpreted_cuda(monkeypatch):
    from halserve.platforms.cuda import CudaPlatform

    _interpret_on_cpu(monkeypatch, CudaPlatform, capability=lambda self, index=0: (9, 0))


def _run(path, prompts, platform="cuda", **kwargs):
    from halserve import LLM, SamplingParams

    kwargs.setdefault("attention_backend", "triton_paged")
    llm = LLM(path, platform=platform, dtype="float32", max_num_batched_tokens=BUDGET, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # the same prompts again: every full block of each prompt is now a prefix-cache hit
    second = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, first, second


@pytest.mark.parametrize("arch", list(CASES))
def test_cuda_stack_interpreted_matches_transformers(arch, interpreted_cuda, tmp_path, caplog):
    from engine_helpers import hf_greedy, prompt_lengths
    from model_factory import make_checkpoint

    ckpt_overrides, engine_overrides = CASES[arch]
    engine_overrides = {"block_size": BLOCK, **engine_overrides}
    block = engine_overrides["block_size"]
    # head_dim 64: the smallest head size triton_paged takes
    path = make_checkpoint(str(tmp_path), arch, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64,
                           **ckpt_overrides)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in prompt_lengths(BLOCK, BUDGET)]
    expected = hf_greedy(path, prompts, NEW_TOKENS)

    with caplog.at_level(logging.INFO, logger="halserve"):
        llm, first, second = _run(path, prompts, **engine_overrides)

    runner = llm.llm_engine.core.executor.worker.model_runner
    assert runner.attn_backend_cls.name == "triton_paged"
    if engine_overrides.get("attention_backend", "forced") is None:
        assert "attention backend triton_paged selected; skipped flash_attn: dtype float32 not supported" in caplog.text
    layer = runner.model.model.layers[0]
    kernels = {type(layer.input_layernorm.kernel).name, type(layer.mlp.act_fn.kernel).name,
               type(layer.self_attn.rotary_emb.kernel).name}
    assert kernels == {"triton_cuda"}, f"the cuda plugin's Triton kernels should serve the layers, got {kernels}"
    for i, (a, b, e) in enumerate(zip(first, second, expected)):
        assert a.outputs[0].token_ids == e, f"{arch}: prompt {i} (len {len(prompts[i])}) differs"
        assert b.outputs[0].token_ids == e, f"{arch}: prompt {i} (len {len(prompts[i])}) differs after prefix hits"
    long_prompts = [j for j, p in enumerate(prompts) if len(p) > block]
    assert all(second[j].num_cached_tokens >= block for j in long_prompts), "the second pass should hit the cache"


def test_cuda_stack_interpreted_split_k_decode(interpreted_cuda, tmp_path, monkeypatch):
    """Every step through the split-K attention launch and its reduce (forced; on a GPU only
    long decode-only steps split)."""
    from engine_helpers import hf_greedy
    from model_factory import make_checkpoint

    monkeypatch.setenv("HALSERVE_TRITON_ATTN_SPLITS", "4")
    path = make_checkpoint(str(tmp_path), "llama", hidden_size=128, num_heads=4, num_kv_heads=1, head_dim=64)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 40, 90)]
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    _, first, second = _run(path, prompts, block_size=BLOCK)
    for i, (a, b, e) in enumerate(zip(first, second, expected)):
        assert a.outputs[0].token_ids == e, f"prompt {i} differs"
        assert b.outputs[0].token_ids == e, f"prompt {i} differs after prefix hits"


@pytest.mark.parametrize("gfx,fp8", [("gfx942", torch.float8_e4m3fnuz), ("gfx950", torch.float8_e4m3fn)])
def test_rocm_stack_interpreted(gfx, fp8, monkeypatch, tmp_path):
    """The rocm platform's own registrations (triton_paged_rocm, the triton_rocm kernels) in the
    engine: greedy-identical to transformers, and an fp8 KV cache in the part's e4m3 flavour
    (MI300's e4m3fnuz, MI350's OCP e4m3fn) written and read through a whole generation."""
    from engine_helpers import hf_greedy
    from model_factory import make_checkpoint

    from halserve.platforms.rocm import RocmPlatform

    _interpret_on_cpu(monkeypatch, RocmPlatform, gfx_arch=staticmethod(lambda index=0: gfx))
    path = make_checkpoint(str(tmp_path), "llama", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 29, 70)]
    expected = hf_greedy(path, prompts, NEW_TOKENS)

    llm, first, second = _run(path, prompts, platform="rocm", block_size=BLOCK, attention_backend=None)
    runner = llm.llm_engine.core.executor.worker.model_runner
    assert runner.attn_backend_cls.name == "triton_paged_rocm"
    assert type(runner.model.model.layers[0].input_layernorm.kernel).name == "triton_rocm"
    for i, (a, b, e) in enumerate(zip(first, second, expected)):
        assert a.outputs[0].token_ids == e and b.outputs[0].token_ids == e, f"prompt {i} differs"

    from halserve import LLM, SamplingParams

    llm = LLM(path, platform="rocm", dtype="float32", max_num_batched_tokens=BUDGET, block_size=BLOCK,
              kv_cache_dtype="fp8")
    runner = llm.llm_engine.core.executor.worker.model_runner
    assert all(cache.dtype == fp8 for cache in runner.kv_caches)
    if fp8 == torch.float8_e4m3fnuz:
        return  # the interpreter cannot cast to e4m3fnuz ("fail to convert fp8e4b8"); the GPU tests write it
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert any(cache.float().abs().sum() > 0 for cache in runner.kv_caches), "nothing was written to the cache"
    # fp8 K/V change the numbers a little (and the interpreter rounds some fp32->fp8 casts
    # wrongly): every request still runs to its length, and most first tokens agree
    assert [len(o.outputs[0].token_ids) for o in first] == [NEW_TOKENS] * len(prompts)
    assert sum(o.outputs[0].token_ids[0] == e[0] for o, e in zip(first, expected)) >= 2


def test_cuda_stack_interpreted_with_speculative_decoding(interpreted_cuda, tmp_path):
    """Drafts checked by the triton_paged kernel (each decode a short span over its cached
    context, with the drafts' K/V written by the Triton cache kernel), from prompt lookup and from
    a draft model (the target itself: every draft accepted): greedy-identical to transformers."""
    from engine_helpers import assert_speculation_matches, hf_greedy
    from model_factory import make_checkpoint

    path = make_checkpoint(str(tmp_path), "llama", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64,
                           layer_scale=0.6)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 20, 40)]
    assert_speculation_matches(path, prompts, hf_greedy(path, prompts, 24), 24, platform="cuda", dtype="float32",
                               block_size=BLOCK, max_num_batched_tokens=BUDGET, attention_backend="triton_paged")
