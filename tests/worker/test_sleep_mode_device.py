"""Sleep mode on a device platform's path (issue 30 item 5): worker/sleep_mode.py with the defaults a
device platform inherits, ``Platform.offload_weights`` / ``restore_weights`` / ``release_memory``, and
decode steps replayed from captured graphs (the old ones read the dropped KV cache and weights, so
``wake_up`` captures them again).

- On the CPU: the cpu platform's own no-op offload is swapped for the base class's, and its graph
  capture for the reference ``EagerReplayCapture``: the weights are copied out and back, nothing keeps
  the dropped KV cache alive, and greedy outputs after ``wake_up`` equal those before.
- On a CUDA GPU (``gpu``): the cuda platform as it is. sleep(level=1) moves the weights to pinned host
  memory, sleep(level=2) drops them; both drop the KV cache, and the device memory goes back to the
  driver (``torch.cuda.mem_get_info``), not only to torch's caching allocator; after ``wake_up`` the
  pinned host copies are gone from torch's host allocator too (``host_memory_stats``). ``mem_get_info`` counts
  every process on the device, so benchmarks/gpu/run_gpu_checks.sh runs this file's ``gpu`` test alone,
  after the parallel GPU tests.

The CPU platform's own sleep (RSS released to the OS) is tests/engine/test_sleep_mode.py.
"""
from __future__ import annotations

import gc
import random
import weakref
from dataclasses import dataclass

import pytest
import torch

from halserve.platforms.graph_capture import EagerReplayCapture

BLOCK = 16
NEW_TOKENS = 16


def _greedy(llm, prompts: list[list[int]]) -> list[list[int]]:
    from halserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _greedy_through_graphs(llm, prompts: list[list[int]]) -> list[list[int]]:
    """``_greedy``, asserting that decode steps replayed the runner's current graphs."""
    graphs = llm.llm_engine.core.executor.worker.model_runner.step_graphs
    assert graphs is not None, "no graphs: wake_up did not capture them again"
    replay, replayed = graphs.replay, []

    def counting(*args, **kwargs):
        hidden = replay(*args, **kwargs)
        replayed.append(hidden is not None)
        return hidden

    graphs.replay = counting
    try:
        tokens = _greedy(llm, prompts)
    finally:
        graphs.replay = replay
    assert any(replayed), "no decode step replayed a captured graph"
    return tokens


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (5, 17, 40, 90)]


# -- the defaults, on the CPU ---------------------------------------------------------------------
@pytest.mark.slow  # an engine put to sleep twice, its graphs captured three times (~8 s)
def test_default_offload_and_graph_capture_survive_sleep_on_cpu(tmp_path, monkeypatch) -> None:
    from model_factory import make_checkpoint

    from halserve import LLM
    from halserve.platforms.base import Platform
    from halserve.platforms.cpu import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "offload_weights", Platform.offload_weights)
    monkeypatch.setattr(CpuPlatform, "restore_weights", Platform.restore_weights)
    monkeypatch.setattr(CpuPlatform, "graph_capture", lambda self: EagerReplayCapture())
    path = make_checkpoint(str(tmp_path), "llama", layer_scale=0.8)
    prompts = _prompts(500)
    llm = LLM(path, platform="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=64, max_model_len=256,
              max_num_seqs=4, max_num_batched_tokens=64, enable_sleep_mode=True)
    try:
        runner = llm.llm_engine.core.executor.worker.model_runner
        before = _greedy_through_graphs(llm, prompts)
        for level in (1, 2):
            graphs, kv_cache = runner.step_graphs, weakref.ref(runner.kv_caches[0])
            model = runner.model
            where = {name: p.data_ptr() for name, p in model.named_parameters()}
            llm.sleep(level=level)
            gc.collect()
            assert kv_cache() is None, "something still holds the dropped KV cache (graphs, metadata, a layer)"
            assert runner.step_graphs is None
            if level == 1:  # copied out to new host tensors, in the same Parameter objects (an empty one:
                # the CPU GEMM's repacked copy, a plain attribute, holds the weight)
                assert runner.model is model
                assert all(p.data_ptr() != where[name] for name, p in model.named_parameters() if p.numel())
            else:
                assert runner.model is None
            llm.wake_up()
            assert runner.step_graphs is not None and runner.step_graphs is not graphs
            assert (runner.model is model) == (level == 1)
            assert _greedy_through_graphs(llm, prompts) == before, f"greedy outputs changed after a level-{level} sleep"
    finally:
        llm.llm_engine.shutdown()


# -- the cuda platform, on an NVIDIA GPU ----------------------------------------------------------
@dataclass
class DeviceMemory:
    allocated: int  # bytes in live tensors (torch.cuda.memory_allocated: this process)
    free: int  # bytes the driver can hand out (torch.cuda.mem_get_info: every process)


def _device_memory() -> DeviceMemory:
    torch.cuda.synchronize()
    return DeviceMemory(torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0])


def _pinned_bytes() -> int | None:
    """Pinned host memory torch's host allocator holds, its cached free blocks included (each block
    rounded up to a power of two); None where this torch's ``host_memory_stats`` does not count it."""
    stats = torch.cuda.host_memory_stats()
    return int(stats["allocated_bytes.current"]) if "allocated_bytes.current" in stats else None


def _pinned_grew_by(before: int | None, at_least: int) -> bool:
    now = _pinned_bytes()
    return before is None or now is not None and now - before >= at_least


def _pinned_back_to(before: int | None) -> bool:  # (16 MiB of slack for torch's own pinned buffers)
    now = _pinned_bytes()
    return before is None or now is not None and now <= before + (16 << 20)


def _weight_bytes(model: torch.nn.Module) -> int:
    """Every storage sleep mode moves (parameters, buffers, kernels' prepared copies; tied weights once)."""
    from halserve.platforms.weight_moves import weight_storages

    return sum(t.untyped_storage().nbytes() for t in weight_storages(model))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None,
                    reason="needs an NVIDIA GPU (torch.cuda.is_available() is False, or torch is a ROCm build); "
                           "benchmarks/gpu/run_gpu_checks.sh runs it on one")
def test_sleep_hands_device_memory_back_and_wake_up_restores_greedy_outputs(tmp_path) -> None:
    from model_factory import make_checkpoint

    from halserve import LLM

    # ~305 MB of float32 weights; head_dim 128 (triton_paged takes 64 and up, as on real models)
    path = make_checkpoint(str(tmp_path), "llama", vocab_size=8192, hidden_size=1024, num_layers=4, num_heads=8,
                           num_kv_heads=4, head_dim=128, intermediate_size=4096, layer_scale=0.6)
    prompts = _prompts(8000)
    # KV cache: 2048 blocks x 4 layers x K/V x 16 tokens x 4 kv heads x 128 x 4 bytes = 512 MiB
    llm = LLM(path, platform="cuda", dtype="float32", block_size=BLOCK, num_kv_blocks=2048, max_model_len=512,
              max_num_seqs=8, max_num_batched_tokens=256, attention_backend="triton_paged", enable_sleep_mode=True)
    try:
        runner = llm.llm_engine.core.executor.worker.model_runner
        assert runner.step_graphs is not None and type(runner.step_graphs.capture).__name__ == "CudaGraphCapture"
        weights = _weight_bytes(runner.model)
        kv_cache = sum(t.numel() * t.element_size() for t in runner.kv_caches)
        assert kv_cache >= 512 << 20 and weights >= 290 << 20, (kv_cache, weights)
        before = _greedy_through_graphs(llm, prompts)

        for level in (1, 2):
            awake, pinned_awake = _device_memory(), _pinned_bytes()
            llm.sleep(level=level)
            asleep = _device_memory()
            assert llm.is_sleeping()
            if level == 1:  # the weights wait in pinned host memory
                assert all(p.device.type == "cpu" and p.is_pinned() for p in runner.model.parameters())
                assert _pinned_grew_by(pinned_awake, weights), (_pinned_bytes(), pinned_awake, weights)
            else:
                assert runner.model is None
            assert runner.step_graphs is None and runner.kv_caches == []
            # every KV-cache and weight tensor left the device (and the graphs' pool with them) ...
            assert awake.allocated - asleep.allocated >= kv_cache + weights, (level, awake, asleep, kv_cache, weights)
            # ... and the driver got the memory back (small weights may share a 2 MiB segment with a
            # live tensor: 95%)
            assert asleep.free - awake.free >= 0.95 * (kv_cache + weights), (level, awake, asleep, kv_cache, weights)

            llm.wake_up()
            assert not llm.is_sleeping()
            assert all(p.device.type == "cuda" for p in runner.model.parameters())
            # the host copies are freed and torch's pinned cache hands their blocks back
            assert _pinned_back_to(pinned_awake), (level, _pinned_bytes(), pinned_awake)
            assert sum(t.numel() * t.element_size() for t in runner.kv_caches) == kv_cache
            assert _device_memory().allocated - asleep.allocated >= kv_cache + weights
            assert _greedy_through_graphs(llm, prompts) == before, f"greedy outputs changed after a level-{level} sleep"

        # level 1, then level 2: the host copy of the weights goes too; wake_up reloads the checkpoint
        pinned_awake = _pinned_bytes()
        llm.sleep(level=1)
        level1 = _device_memory()
        llm.sleep(level=2)
        assert runner.model is None and _device_memory().allocated <= level1.allocated
        assert _pinned_back_to(pinned_awake), (_pinned_bytes(), pinned_awake)  # (release_memory emptied it)
        llm.wake_up()
        assert _greedy_through_graphs(llm, prompts) == before
    finally:
        llm.llm_engine.shutdown()
