"""A request's ``priority`` through the engine: it crosses the engine-core wire, ``LLM.generate(priority=...)``
under ``scheduling_policy="priority"`` gives FCFS's greedy outputs (with preemption), and ``fcfs`` refuses a
priority other than 0 with a message naming the flag."""
from __future__ import annotations

import pytest

from halserve.engine.serial import decode_request, encode_request
from halserve.engine.types import EngineCoreRequest
from halserve.sampling_params import SamplingParams


def test_priority_crosses_the_engine_core_wire():
    req = EngineCoreRequest("r1", "r1", 0, [5, 6, 7], SamplingParams(max_tokens=3), {2}, 3, 1.5, priority=-7)
    back = decode_request(encode_request(req))
    assert back.priority == -7 and back.prompt_token_ids == [5, 6, 7] and back.arrival_time == 1.5


@pytest.mark.slow  # loads the demo model twice
def test_llm_priority_outputs_equal_fcfs_and_fcfs_refuses_priority():
    from halserve import LLM
    from halserve.demo import DEMO_MODEL_PATH

    prompts = [f"{a}+{b}=" for a, b in ((12, 34), (500, 77), (9, 9), (123, 456), (31, 4), (70, 80))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    # a small cache and two seats: later, higher priorities preempt earlier, lower ones
    kwargs = dict(platform="cpu", num_kv_blocks=12, block_size=4, max_num_seqs=2, max_num_batched_tokens=64,
                  max_model_len=32)
    fcfs = LLM(DEMO_MODEL_PATH, **kwargs)
    want = [o.outputs[0].token_ids for o in fcfs.generate(prompts, params, use_tqdm=False)]
    with pytest.raises(ValueError, match=r"priority=1 .*--scheduling-policy priority"):
        fcfs.generate(prompts[:1], params, use_tqdm=False, priority=[1])
    assert [o.outputs[0].token_ids for o in fcfs.generate(prompts[:1], params, use_tqdm=False)] == want[:1]
    del fcfs

    llm = LLM(DEMO_MODEL_PATH, scheduling_policy="priority", **kwargs)
    got = llm.generate(prompts, params, use_tqdm=False, priority=[5, 5, 3, 1, 0, -2])
    assert [o.outputs[0].token_ids for o in got] == want
    # arrivals over time: the low ones run, then higher priorities arrive and preempt them
    engine = llm.llm_engine
    finished: dict[str, list[int]] = {}
    order: list[str] = []

    def step():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
                order.append(out.request_id)

    for i, priority in enumerate([5, 5, 3, 1, 0, -2]):
        engine.add_request(f"p{i}", prompts[i], params, priority=priority)
        step()
        step()
    while engine.has_unfinished_requests():
        step()
    assert [finished[f"p{i}"] for i in range(6)] == want
    assert engine.core.scheduler.num_preemptions > 0
    assert order.index("p5") < order.index("p1")  # (the last, most urgent one overtook the running low ones)
    with pytest.raises(ValueError, match="got 6 prompts but 2 priorities"):
        llm.generate(prompts, params, use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.generate(prompts[:1], params, use_tqdm=False, priority=[1.5])
