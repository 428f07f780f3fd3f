"""DeepSeek-V2 (V2-Lite-shaped, tests/models/test_deepseek.py's tiny checkpoint) through the cpu_native
backend's MLA: decodes on the native kernel (platforms/cpu_kernels/mla_decode.cpp), prefills on the torch
backend's expanded path. Greedy tokens must equal transformers', step by step and through the engine
(chunked prefill, batched decodes)."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import generate_ids, greedy_params, hf_greedy
from paged_harness import PagedHarness
from test_deepseek import checkpoint  # noqa: F401 - the module's checkpoint fixture

from halserve.attention_backends.cpu_native import CpuNativeAttentionBackend
from halserve.platforms import cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels.toolchain_missing() is not None, reason=f"no C++ toolchain: {cpu_kernels.toolchain_missing()}"
)


def _load_cpu_native(path: str):
    from halserve.config import EngineConfig
    from halserve.models.loader import get_model_info, load_model
    from halserve.platforms.cpu import CpuPlatform

    config = EngineConfig(model=path, dtype="float32")
    platform = CpuPlatform()
    return load_model(config, get_model_info(config, platform), platform, CpuNativeAttentionBackend, progress=False)


def test_v2_lite_greedy_decode_through_the_native_kernel_matches_transformers(checkpoint, monkeypatch):  # noqa: F811
    path = checkpoint("v2_lite")
    model = _load_cpu_native(path)
    assert all(isinstance(layer.backend, CpuNativeAttentionBackend) for layer in model.attention_layers)
    num_blocks, block_size = 64, 4
    harness = PagedHarness(model, CpuNativeAttentionBackend, num_blocks=num_blocks, block_size=block_size)
    for layer in model.attention_layers:  # the latent pages instead of per-head K/V
        layer.kv_cache = torch.zeros(layer.kv_cache_spec.cache_shape(num_blocks, block_size))
    calls = []  # every decode token goes through the kernel
    kernel = torch.ops.halserve_cpu_mla.mla_decode if cpu_kernels.load_library("mla") else None
    assert kernel is not None, cpu_kernels.load_error("mla")
    for layer in model.attention_layers:
        monkeypatch.setattr(layer.backend, "_mla_decode", lambda q, *a, _k=kernel: calls.append(q.shape[0]) or _k(q, *a))

    prompts = [[1, 5, 9, 33, 70, 200, 7, 8, 9, 10, 11, 12, 13], [1, 300, 301, 7], [1, 44]]
    max_new = 6
    logits = harness.step([(f"r{i}", p) for i, p in enumerate(prompts)])  # one flattened prefill
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    generated = [[int(logits[e].argmax())] for e in ends]
    assert calls == []  # prefills take the expanded path
    for _ in range(max_new - 1):  # batched decodes, all in batch order
        logits = harness.step([(f"r{i}", [g[-1]]) for i, g in enumerate(generated)])
        for i, g in enumerate(generated):
            g.append(int(logits[i].argmax()))
    assert calls == [len(prompts)] * (max_new - 1) * len(model.attention_layers)
    want = hf_greedy(path, prompts, max_new)
    assert generated == want


def test_engine_picks_cpu_native_and_matches_transformers(checkpoint):  # noqa: F811
    """Chunked prefills (16-token steps), decodes mixed with chunks, then decodes only."""
    from halserve import LLM

    path = checkpoint("v2_lite")
    prompts = [[1, 45, 74, 299, 17, 273, 5, 88, 410, 9, 33, 61, 7, 190, 222, 3, 48, 91, 120, 6], [1, 300, 301],
               [1] + [200 + 3 * i for i in range(24)]]
    max_tokens = 10
    want = hf_greedy(path, prompts, max_tokens)
    llm = LLM(path, platform="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16, max_model_len=64)
    try:
        runner = llm.llm_engine.core.executor.worker.model_runner
        assert runner.attn_backend_cls is CpuNativeAttentionBackend  # chosen automatically
        assert generate_ids(llm, prompts, greedy_params(max_tokens)) == want
    finally:
        llm.llm_engine.shutdown()
