"""Sleep mode and weight updates through ``LLM`` (issue 30 item 5): sleep(1|2) releases memory to the
OS (RSS measured), wake_up restores greedy outputs, update_weights swaps checkpoints (and refuses a
mismatched one, leaving the old weights serving), collective_rpc, reset_prefix_cache, requests while
asleep; the same across the ``mp`` executor's tensor-parallel workers."""
from __future__ import annotations

import gc
import glob
import os

import psutil
import pytest

from halserve import LLM, SamplingParams
from halserve.engine.core import EngineSleepingError

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]},
           {"prompt_token_ids": [11, 12, 13]}]
ENGINE_KWARGS = dict(platform="cpu", dtype="float32", max_model_len=256, block_size=16, num_kv_blocks=128,
                     max_num_seqs=4, max_num_batched_tokens=256)


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def _weights_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*.safetensors")))


@pytest.fixture(scope="module")
def medium_checkpoint(tmp_path_factory) -> str:
    """~52 MB of float32 weights: enough for an RSS drop to stand out from the process's noise."""
    from model_factory import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("sleep_llama")), "llama", vocab_size=512, hidden_size=768,
                           num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=2048)


def test_sleep_releases_memory_to_the_os_and_wake_up_restores_outputs(medium_checkpoint):
    llm = LLM(medium_checkpoint, enable_sleep_mode=True, **ENGINE_KWARGS)
    try:
        before = _greedy(llm)
        weights = _weights_bytes(medium_checkpoint)
        caches = llm.llm_engine.core.executor.worker.model_runner.kv_caches
        kv_cache = sum(t.numel() * t.element_size() for t in caches)
        for cache in caches:  # (the CPU's cache takes RAM as blocks are first written: as if all had been used)
            cache.add_(0)

        awake = _rss()
        llm.sleep(level=1)  # the KV cache goes; the weights stay (they already live in host memory)
        level1 = _rss()
        assert llm.is_sleeping()
        assert awake - level1 >= kv_cache, (awake, level1, kv_cache)
        llm.sleep(level=2)  # now the weights go too
        level2 = _rss()
        assert level1 - level2 >= weights * 0.95, (level1, level2, weights)
        assert awake - level2 >= weights + kv_cache, (awake, level2, weights, kv_cache)

        with pytest.raises(EngineSleepingError, match=r"asleep.*wake_up"):
            _greedy(llm)
        assert not llm.llm_engine.has_unfinished_requests()  # (the refused request left nothing behind)

        llm.wake_up()
        assert not llm.is_sleeping()
        assert _greedy(llm) == before

        awake = _rss()
        llm.sleep(level=2)  # straight to level 2: the weights' size and more
        assert awake - _rss() >= weights
        llm.wake_up()
        assert _greedy(llm) == before
    finally:
        llm.llm_engine.shutdown()


def _rank_rss(worker) -> int:
    """Run in a worker process: its RSS after a collection."""
    gc.collect()
    return psutil.Process().memory_info().rss


def test_mp_workers_each_release_their_weights(medium_checkpoint):
    llm = LLM(medium_checkpoint, enable_sleep_mode=True, tensor_parallel_size=2, distributed_executor_backend="mp",
              **ENGINE_KWARGS)
    try:
        before = _greedy(llm)
        assert len(set(llm.collective_rpc("memory_in_use"))) == 2  # (one answer per rank, from two processes)
        awake = llm.collective_rpc(_rank_rss)
        llm.sleep(level=2)
        asleep = llm.collective_rpc(_rank_rss)
        share = _weights_bytes(medium_checkpoint) / 2
        for rank, (a, b) in enumerate(zip(awake, asleep)):
            assert a - b >= share * 0.9, f"rank {rank} released {(a - b) >> 20} MiB of its ~{int(share) >> 20} MiB"
        llm.wake_up()
        assert _greedy(llm) == before
    finally:
        llm.llm_engine.shutdown()


def test_update_weights_serves_the_new_checkpoint_and_refuses_a_mismatch(checkpoint_factory):
    first = checkpoint_factory("llama")
    second = checkpoint_factory("llama", seed=1)
    wider = checkpoint_factory("llama", hidden_size=128)
    fresh = LLM(second, **ENGINE_KWARGS)
    try:
        expected_second = _greedy(fresh)
        with pytest.raises(ValueError, match="enable_sleep_mode"):  # (sleep needs the flag)
            fresh.sleep(1)
    finally:
        fresh.llm_engine.shutdown()

    llm = LLM(first, enable_sleep_mode=True, **ENGINE_KWARGS)
    try:
        expected_first = _greedy(llm)
        assert expected_first != expected_second  # (the test could not tell them apart otherwise)
        assert llm.collective_rpc("attention_backend_name") == ["cpu_native"]  # one result per worker
        assert llm.collective_rpc(_rank_rss)[0] > 0  # a function runs on the worker too

        llm.update_weights(second)  # awake and idle
        assert _greedy(llm) == expected_second

        llm.sleep(level=2)
        llm.update_weights(first)  # asleep: wake_up then serves these
        llm.wake_up()
        assert _greedy(llm) == expected_first
        llm.sleep(level=2)
        llm.wake_up()  # level 2 reloads from the checkpoint update_weights loaded last
        assert _greedy(llm) == expected_first

        with pytest.raises(ValueError, match=r"hidden_size 128 \(served: 64\).*old weights keep serving"):
            llm.update_weights(wider)
        with pytest.raises(ValueError, match="not a checkpoint folder"):
            llm.update_weights(os.path.join(first, "missing"))
        assert _greedy(llm) == expected_first  # still the old weights

        assert llm.reset_prefix_cache() is True
        with pytest.raises(ValueError, match="sleep level must be 1"):
            llm.sleep(level=3)
        with pytest.raises(ValueError, match="timeout"):
            llm.collective_rpc("memory_in_use", timeout=1.0)
        with pytest.raises(ValueError, match="the worker has no method 'memory_used'; call one of .*memory_in_use"):
            llm.collective_rpc("memory_used")
    finally:
        llm.llm_engine.shutdown()


def test_update_weights_refuses_a_checkpoint_missing_tensors(checkpoint_factory, tmp_path):
    """Same config, but a tensor is missing from its safetensors: a ValueError naming it, weights unchanged."""
    import shutil

    from safetensors.torch import load_file, save_file

    first = checkpoint_factory("llama")
    broken = tmp_path / "broken"
    shutil.copytree(first, broken)
    (shard,) = glob.glob(str(broken / "*.safetensors"))
    tensors = load_file(shard)
    dropped = next(name for name in tensors if name.endswith("mlp.down_proj.weight"))
    del tensors[dropped]
    save_file(tensors, shard, metadata={"format": "pt"})
    llm = LLM(first, **ENGINE_KWARGS)
    try:
        expected = _greedy(llm)
        with pytest.raises(ValueError, match=r"could not be loaded.*down_proj.*old weights keep serving"):
            llm.update_weights(str(broken))
        assert _greedy(llm) == expected
    finally:
        llm.llm_engine.shutdown()


def test_lora_adapters_survive_a_level_2_sleep(checkpoint_factory, tmp_path):
    """The workers load their adapters again with the weights (the engine still counts them as loaded)."""
    from lora_factory import make_adapter

    from halserve.lora.request import LoRARequest

    base = checkpoint_factory("llama")
    lora = LoRARequest("a1", 1, make_adapter(tmp_path / "a1", base, r=8, seed=1))
    llm = LLM(base, enable_sleep_mode=True, enable_lora=True, max_lora_rank=8, **ENGINE_KWARGS)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    try:
        before = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)]
        assert before != _greedy(llm)  # (the adapter changes the outputs)
        llm.sleep(level=2)
        llm.wake_up()
        assert llm.collective_rpc("list_loras") == [[1]]
        after = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)]
        assert after == before
    finally:
        llm.llm_engine.shutdown()


def test_async_llm_sleeps_through_its_engine_thread(checkpoint_factory):
    import asyncio

    from halserve.config import EngineConfig
    from halserve.engine.async_llm import AsyncLLM

    config = EngineConfig(model=checkpoint_factory("llama"), enable_sleep_mode=True, **ENGINE_KWARGS)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def main():
        llm = AsyncLLM.from_config(config)
        try:
            async def ids():
                return [out async for out in llm.generate({"prompt_token_ids": [5, 6, 7]}, params)][-1] \
                    .outputs[0].token_ids
            before = await ids()
            await llm.sleep(2)
            assert await llm.is_sleeping()
            with pytest.raises(EngineSleepingError):
                await ids()
            await llm.wake_up()
            assert await ids() == before
            assert len(await llm.collective_rpc("memory_in_use")) == 1
            assert await llm.reset_prefix_cache()
        finally:
            await llm.shutdown()

    asyncio.run(asyncio.wait_for(main(), timeout=120))
