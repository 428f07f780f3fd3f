"""AsyncLLM against a fake core: the engine thread, streams, aborts, failures, shutdown."""
from __future__ import annotations

import asyncio

import pytest
from fake_core import FakeCore, make_async_llm

from halserve.engine.async_llm import EngineDeadError
from halserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_generate_streams_cumulative_outputs_from_the_engine_thread():
    async def main():
        core = FakeCore()
        llm = make_async_llm(core)
        outs = [o async for o in llm.generate("ab", SamplingParams(max_tokens=5, temperature=0), "r1")]
        await llm.shutdown()
        return core, outs

    core, outs = run(main())
    final = outs[-1]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert final.outputs[0].text == "cdefg"  # each step: the letter after the last token
    assert len(final.outputs[0].token_ids) == 5
    assert core.threads == {"halserve-engine"}  # the core is only touched by its thread
    assert core.is_shut_down


def test_n_samples_and_concurrent_requests():
    async def main():
        llm = make_async_llm(FakeCore())

        async def one(i):
            outs = [o async for o in llm.generate("a", SamplingParams(n=2, temperature=1.0, max_tokens=3), f"r{i}")]
            return outs[-1]

        finals = await asyncio.gather(*(one(i) for i in range(8)))
        await llm.shutdown()
        return finals

    for final in run(main()):
        assert [o.text for o in final.outputs] == ["bcd", "bcd"]


def test_bad_input_raises_value_error_before_any_output():
    async def main():
        llm = make_async_llm(FakeCore())
        errors = []
        for prompt in ("", [], [999], "x" * 50):  # empty, empty ids, out of vocab, can never fit
            with pytest.raises(ValueError) as info:
                async for _ in llm.generate(prompt, SamplingParams(max_tokens=2), None):
                    pass
            errors.append(str(info.value))
        # still serving
        outs = [o async for o in llm.generate("a", SamplingParams(max_tokens=2, temperature=0))]
        await llm.shutdown()
        return errors, outs

    errors, outs = run(main())
    assert all(errors) and "never fit" in errors[-1]
    assert outs[-1].outputs[0].text == "bc"


def test_cancelling_the_consumer_aborts_the_request_in_the_core():
    async def main():
        core = FakeCore(step_delay=0.01)
        llm = make_async_llm(core)
        got_one = asyncio.Event()

        async def consume():
            async for _ in llm.generate("a", SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True), "slow"):
                got_one.set()

        task = asyncio.create_task(consume())
        await got_one.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if "slow" in core.aborted:
                break
            await asyncio.sleep(0.01)
        steps = core.num_steps
        await asyncio.sleep(0.1)
        idle_steps = core.num_steps - steps
        await llm.shutdown()
        return core, idle_steps

    core, idle_steps = run(main())
    assert core.aborted == ["slow"] and not core.running
    assert idle_steps == 0  # idle engine blocks on its queue, no busy stepping


def test_engine_death_reaches_every_stream_and_health():
    async def main():
        llm = make_async_llm(FakeCore(fail_after=2))
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate("a", SamplingParams(max_tokens=50, temperature=0)):
                pass
        assert not llm.is_healthy and llm.dead_error is not None
        with pytest.raises(EngineDeadError):
            await llm.add_request("a", SamplingParams(max_tokens=2))
        await llm.shutdown()

    run(main())


def test_shutdown_ends_in_flight_requests_with_abort():
    async def main():
        core = FakeCore(step_delay=0.01)
        llm = make_async_llm(core)
        stream = await llm.add_request("a", SamplingParams(max_tokens=1000, temperature=0), "long")
        await stream.__anext__()
        await llm.shutdown()
        rest = [o async for o in stream]
        return core, rest

    core, rest = run(main())
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert core.is_shut_down


def test_a_batch_is_queued_in_one_engine_round_trip_all_or_none():
    """``submit_all`` (a multi-prompt request) queues every prompt in one round trip while the
    engine is busy stepping; one the core refuses is a ValueError naming its place in the batch,
    and none of the batch runs."""
    async def main():
        core = FakeCore(step_delay=0.02)
        llm = make_async_llm(core)
        sent = []
        add = llm.client.add_requests

        async def counting(core_requests):
            sent.append([r.request_id for r in core_requests])
            return await add(core_requests)

        llm.client.add_requests = counting
        busy = llm.generate("a", SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True), "busy")
        await busy.__anext__()  # the engine is stepping
        steps = core.num_steps
        prepared = [await llm.prepare_request("ab", SamplingParams(max_tokens=3, temperature=0), f"b{i}")
                    for i in range(16)]
        streams = await llm.submit_all(prepared)
        queued_within = core.num_steps - steps
        finals = []
        for stream in streams:
            finals.append([o async for o in stream][-1])

        bad = [await llm.prepare_request(p, SamplingParams(max_tokens=3, temperature=0), f"c{i}")
               for i, p in enumerate(["ab", "cd", "x" * 45, "ef"])]  # the third can never fit
        with pytest.raises(ValueError, match="never fit") as info:
            await llm.submit_all(bad)
        running_after = set(core.running)
        aborted = list(core.aborted)
        await busy.aclose()
        await llm.shutdown()
        return sent, queued_within, finals, info.value, running_after, aborted

    sent, queued_within, finals, error, running_after, aborted = run(main())
    assert sent[1] == [f"b{i}" for i in range(16)]  # one round trip for the 16 prompts
    assert queued_within <= 2  # not one engine step per prompt
    assert [f.outputs[0].text for f in finals] == ["cde"] * 16
    assert error.batch_index == 2
    assert sent[2] == ["c0", "c1", "c2", "c3"]
    assert not running_after & {"c0", "c1", "c2", "c3"}  # all or none: the two added first were undone
    assert {"c0", "c1"} <= set(aborted)
