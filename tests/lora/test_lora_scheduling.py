"""The scheduler's LoRA rule (at most max_loras adapters running, without starvation) and the
prefix cache's adapter key, on the scheduler alone (no model)."""
from __future__ import annotations

import pytest

from halserve.lora.request import LoRARequest
from halserve.request import Request
from halserve.sampling_params import SamplingParams
from halserve.scheduler import Scheduler, SchedulerConfig
from halserve.scheduler_output import ModelRunnerOutput

A, B = LoRARequest("a", 1, "/adapters/a"), LoRARequest("b", 2, "/adapters/b")


def make_scheduler(max_loras=1, max_num_seqs=8, prefix=True):
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=128,
                                     block_size=4, num_blocks=64, enable_prefix_caching=prefix, max_loras=max_loras))


def make_request(req_id, lora, max_tokens=3, prompt=(5, 6, 7)):
    return Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=SamplingParams(),
                   max_tokens=max_tokens, lora_request=lora)


def step(sched) -> list[str]:
    """One step in which every request that completes its known tokens samples token 9;
    returns the ids of the requests that started running."""
    so = sched.schedule()
    req_ids = list(so.num_scheduled_tokens)
    sampled = [[9] if sched.requests[r].num_computed_tokens + n >= sched.requests[r].num_tokens else []
               for r, n in so.num_scheduled_tokens.items()]
    for new in so.scheduled_new_reqs:
        assert new.lora_request is sched.requests[new.req_id].lora_request  # the worker learns the adapter
    sched.update_from_output(so, ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids)))
    return [r.req_id for r in so.scheduled_new_reqs]


def running_adapters(sched) -> set[int]:
    return {r.lora_request.lora_int_id for r in sched.running if r.lora_request is not None}


def test_at_most_max_loras_adapters_run_and_all_finish():
    sched = make_scheduler(max_loras=1)
    for req_id, lora in [("a1", A), ("b1", B), ("a2", A), ("n1", None), ("b2", B)]:
        sched.add_request(make_request(req_id, lora))
    started = []
    while sched.has_unfinished_requests():
        started.append(step(sched))
        assert len(running_adapters(sched)) <= 1
    assert started[0] == ["a1", "a2", "n1"]  # b1 passed over, the base request is not held back
    assert sorted(sum(started, [])) == ["a1", "a2", "b1", "b2", "n1"]


def test_two_slots_run_two_adapters_together():
    sched = make_scheduler(max_loras=2)
    for req_id, lora in [("a1", A), ("b1", B), ("n1", None)]:
        sched.add_request(make_request(req_id, lora))
    assert step(sched) == ["a1", "b1", "n1"]


def test_a_passed_over_request_is_not_starved():
    """max_num_seqs=2 bounds overtaking to 2: then nobody is admitted past it until it runs."""
    sched = make_scheduler(max_loras=1, max_num_seqs=2)
    sched.add_request(make_request("a-long", A, max_tokens=8))
    sched.add_request(make_request("b", B, max_tokens=1))
    assert step(sched) == ["a-long"]
    started = []
    for i in range(8):  # a steady stream of short requests on the running adapter
        if len(sched.waiting) < 3:
            sched.add_request(make_request(f"a{i}", A, max_tokens=1))
        started += step(sched)
    while sched.has_unfinished_requests():
        started += step(sched)
    assert started.index("b") <= 2, started  # two overtook it, then it went first


def test_lora_request_refused_without_lora():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=4,
                                      num_blocks=64))
    with pytest.raises(ValueError, match="enable_lora=True"):
        sched.add_request(make_request("a1", A))


def test_prefix_cache_keeps_adapters_apart():
    sched = make_scheduler(max_loras=2)
    prompt = tuple(range(10, 23))  # three full blocks
    sched.add_request(make_request("base", None, max_tokens=1, prompt=prompt))
    step(sched)
    for req_id, lora, hit in [("on-a", A, 0), ("on-b", B, 0), ("base-again", None, 12), ("a-again", A, 12)]:
        request = make_request(req_id, lora, max_tokens=1, prompt=prompt)
        _, num_hit = sched.kv_cache_manager.get_computed_blocks(request)
        assert num_hit == hit, req_id
        sched.add_request(request)
        step(sched)
