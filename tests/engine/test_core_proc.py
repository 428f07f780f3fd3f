"""The engine-core process and its wire format: frames round-trip everything the in-process path
carries, a step batch is cheap to cross, and ``AsyncLLM`` over ``MPEngineCoreClient`` serves,
calls the core, stops cleanly and fails every stream when the process dies."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import pytest

from halserve.engine.serial import (
    FrameReader,
    decode_outputs,
    decode_request,
    decode_stats,
    encode_outputs,
    encode_request,
    encode_stats,
    pack,
)
from halserve.engine.types import EngineCoreRequest, EngineStats
from halserve.engine_core_output import EngineCoreOutput
from halserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # starts engine processes (inner loop: -m 'not slow')


def test_request_round_trips_with_prompt_as_int32_array():
    req = EngineCoreRequest("r1", "r1", 0, [5, 6, 7, 2**31 - 1], SamplingParams(max_tokens=3, temperature=0.5),
                            {2}, 3, 12.5)
    fields = encode_request(req)
    assert fields[3].typecode == "i" and fields[3].itemsize == 4
    frame = pack(("add", 0, [fields]))
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame)
        (message,) = FrameReader(b).read()
    back = decode_request(message[2][0])
    assert back.prompt_token_ids == [5, 6, 7, 2**31 - 1]
    assert back.sampling_params.max_tokens == 3 and back.sampling_params.temperature == 0.5
    assert (back.request_id, back.eos_token_ids, back.max_tokens, back.arrival_time) == ("r1", {2}, 3, 12.5)


def test_outputs_round_trip_with_rare_fields():
    from halserve.scheduler_output import SampleLogprobs

    logprobs = [SampleLogprobs(7, -0.1, 1, [7, 9], [-0.1, -2.5]), SampleLogprobs(8, -0.3, 2, [3, 8], [-0.2, -0.3])]
    outs = [
        EngineCoreOutput("a", [4], None),
        EngineCoreOutput("b", [7, 8], logprobs, "stop", 8, num_cached_tokens=16),
        EngineCoreOutput("c", [], None, "length", pooled=[0.25, 0.75]),
        EngineCoreOutput("d", [3], None, prompt_logprobs=logprobs),
    ]
    back = decode_outputs(encode_outputs(outs))
    for got, want in zip(back, outs):
        assert (got.request_id, got.new_token_ids, got.finish_reason, got.stop_reason, got.num_cached_tokens,
                got.pooled) == (want.request_id, want.new_token_ids, want.finish_reason, want.stop_reason,
                                want.num_cached_tokens, want.pooled)
        assert got.new_logprobs == want.new_logprobs and got.prompt_logprobs == want.prompt_logprobs
    stats = EngineStats(num_running=3, kv_cache_usage=0.5, num_steps=9, extra={"x": 1})
    assert decode_stats(encode_stats(stats)) == stats


def test_output_batch_round_trip_cost():
    """A 256-request decode step crosses a Unix socket pair, encoded and decoded, in well under a
    millisecond per step on one core (printed; the bound is loose for a shared CI machine)."""
    outs = [EngineCoreOutput(f"cmpl-{i:032x}", [i % 500], None) for i in range(256)]
    a, b = socket.socketpair()
    reader = FrameReader(b)
    rounds = 200
    with a, b:
        start = time.perf_counter()
        for _ in range(rounds):
            a.sendall(pack(("outputs", encode_outputs(outs), encode_stats(EngineStats()))))
            messages = reader.read()
            while not messages:
                messages = reader.read()
            back = decode_outputs(messages[0][1])
        per_step = (time.perf_counter() - start) / rounds
    assert len(back) == 256 and back[255].new_token_ids == [255]
    print(f"256-output step batch round trip: {per_step * 1e6:.0f} us")
    assert per_step < 0.02


@pytest.fixture(scope="module")
def demo_config():
    from halserve.config import EngineConfig
    from halserve.demo import DEMO_MODEL_PATH

    return EngineConfig(model=DEMO_MODEL_PATH, platform="cpu")


def test_async_llm_over_engine_process(demo_config):
    from halserve.engine.async_llm import AsyncLLM
    from halserve.engine.core_client import MPEngineCoreClient

    async def main():
        llm = AsyncLLM.from_config(demo_config, multiprocess=True)
        assert isinstance(llm.client, MPEngineCoreClient) and llm.engine_core is None
        process = llm.client.process
        assert process.is_alive() and process.pid != os.getpid()
        outs = [o async for o in llm.generate("123+456=", SamplingParams(max_tokens=8, temperature=0), "r1")]
        assert outs[-1].finished and outs[-1].outputs[0].text == "579"
        assert llm.get_stats().num_steps >= 3
        assert await llm.list_loras() == set()
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            await llm.call_core("add_lora", _lora())
        with pytest.raises(ValueError, match="unknown engine method"):
            await llm.call_core("step")
        await llm.shutdown()
        return process

    process = asyncio.run(main())
    process.join(10)
    assert process.exitcode == 0


def test_a_batch_refused_over_the_process_boundary_names_its_prompt():
    """A batch crosses to the engine-core process in one message, all or none: the core's refusal
    of one prompt (here: it can never fit in the KV cache) comes back naming its place in the batch,
    nothing of the batch was queued, and the engine serves on."""
    from halserve.config import EngineConfig
    from halserve.demo import DEMO_MODEL_PATH
    from halserve.engine.async_llm import AsyncLLM

    config = EngineConfig(model=DEMO_MODEL_PATH, platform="cpu", num_kv_blocks=2, max_model_len=64)

    async def main():
        llm = AsyncLLM.from_config(config, multiprocess=True)
        params = SamplingParams(max_tokens=4, temperature=0)
        batch = [await llm.prepare_request(p, params.clone(), f"r{i}")
                 for i, p in enumerate(["1+1=", "2+2=", "9" * 50, "3+3="])]
        with pytest.raises(ValueError, match="needs 55 tokens of KV cache") as info:
            await llm.submit_all(batch)
        stats = await llm.call_core("get_stats")
        batch = [await llm.prepare_request(p, params.clone(), f"s{i}") for i, p in enumerate(["1+1=", "2+2="])]
        texts = []
        for stream in await llm.submit_all(batch):
            texts.append([o async for o in stream][-1].outputs[0].text)
        await llm.shutdown()
        return info.value, stats, texts

    error, stats, texts = asyncio.run(main())
    assert error.batch_index == 2
    assert stats.num_running == 0 and stats.num_waiting == 0  # the two added before it were undone
    assert texts == ["2", "4"]


def _lora():
    from halserve.lora.request import LoRARequest

    return LoRARequest("x", 1, "/nonexistent")


def test_killed_engine_process_fails_streams(demo_config):
    from halserve.engine.async_llm import AsyncLLM
    from halserve.engine.request_stream import EngineDeadError

    async def main():
        llm = AsyncLLM.from_config(demo_config, multiprocess=True)
        died = asyncio.get_running_loop().create_future()
        llm.death_callbacks.append(lambda exc: died.set_result(exc))
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        stream = await llm.add_request("123+456=", params, "long")
        os.kill(llm.client.process.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        exc = await asyncio.wait_for(died, 5)
        assert time.monotonic() - start < 1.0
        assert "exited" in str(exc) and not llm.is_healthy
        with pytest.raises(EngineDeadError):
            await llm.add_request("1+1=", params)
        await llm.shutdown()

    asyncio.run(main())
