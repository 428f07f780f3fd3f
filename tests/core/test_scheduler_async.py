"""Async scheduling in the scheduler (``SchedulerConfig.async_scheduling``): step N+1 is scheduled
before step N's output is applied, with placeholders for the tokens step N samples. The fake
worker of ``test_scheduler`` (which checks block tables, K/V contents and the computed-token
counts it is sent) runs both ways; the outputs must be the same."""
import random
from collections import deque

import pytest
from scheduler_helpers import make_request
from test_scheduler import BS, FakeWorker, step

from halserve.scheduler import Scheduler, SchedulerConfig


def make_scheduler(async_scheduling, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64,
                   prefix=True):
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     max_model_len=max_model_len, block_size=BS, num_blocks=num_blocks,
                                     enable_prefix_caching=prefix, async_scheduling=async_scheduling))


def run_sync(sched, worker, max_steps=2000):
    results = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        _, outs = step(sched, worker)
        _collect(results, outs)
    assert not sched.has_unfinished_requests()
    return results


def run_async(sched, worker, max_steps=2000):
    """The engine's loop (EngineCore._step_async): schedule and submit step N+1, then apply step
    N's output. The worker runs each step when submitted (in order, like the real one); its output
    reaches the scheduler one step later."""
    results, in_flight = {}, deque()
    max_in_flight = 0
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and not in_flight:
            break
        if sched.has_unfinished_requests():
            so = sched.schedule()
            if not so.is_empty:
                in_flight.append((so, worker.execute(so)))
                max_in_flight = max(max_in_flight, len(in_flight))
                if len(in_flight) == 1:
                    continue
            else:
                sched.unschedule_empty(so)
        if in_flight:
            _collect(results, sched.update_from_output(*in_flight.popleft()))
    assert not sched.has_unfinished_requests() and not in_flight
    assert not sched.async_steps.batches
    assert max_in_flight == 2, "steps should have overlapped"
    return results


def _collect(results, outs):
    for o in outs:
        toks, _, _ = results.get(o.request_id, ([], None, None))
        results[o.request_id] = (toks + o.new_token_ids, o.finish_reason, o.stop_reason)


def _workload(seed):
    rng = random.Random(seed)
    shared = [rng.randrange(1, 50) for _ in range(2 * BS)]
    reqs = []
    for i in range(12):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))]
        kwargs = {}
        if i % 4 == 1:
            kwargs["stop_token_ids"] = [1000 + rng.randrange(997)]
        reqs.append((f"r{i}", prompt, rng.randrange(1, 30), kwargs))
    return reqs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [64, 16])  # 16: 15 usable blocks of 4 tokens force preemption
def test_async_matches_sync(seed, num_blocks):
    outcomes, preemptions = [], []
    for async_scheduling in (False, True):
        sched = make_scheduler(async_scheduling, num_blocks=num_blocks)
        for req_id, prompt, max_tokens, kwargs in _workload(seed):
            # eos 1500..1509: some requests stop early on a token the fake worker samples
            sched.add_request(make_request(req_id, prompt, max_tokens=max_tokens, eos=range(1500, 1510), **kwargs))
        run = run_async if async_scheduling else run_sync
        outcomes.append(run(sched, FakeWorker()))
        preemptions.append(sched.num_preemptions)
    assert outcomes[1] == outcomes[0]
    for req_id, _prompt, max_tokens, _ in _workload(seed):
        assert len(outcomes[1][req_id][0]) <= max_tokens
    if num_blocks == 16:
        assert min(preemptions) > 0


def test_no_placeholder_past_max_tokens_and_late_finish():
    """A request whose step in flight samples its last token is not scheduled again; one that
    stops on a token of a step in flight is found a step late and its extra token dropped."""
    sched = make_scheduler(True)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=2))
    worker = FakeWorker()
    s0 = sched.schedule()  # prefill; samples token 1
    assert sched.requests["a"].num_output_placeholders == 1
    s1 = sched.schedule()  # token 2 on the placeholder
    assert s1.num_scheduled_tokens == {"a": 1} and sched.requests["a"].num_output_placeholders == 2
    assert sched.schedule().is_empty  # max_tokens=2 are both in flight
    o0, o1 = worker.execute(s0), worker.execute(s1)
    out = sched.update_from_output(s0, o0)
    assert len(out[0].new_token_ids) == 1 and out[0].finish_reason is None
    out = sched.update_from_output(s1, o1)
    assert out[0].finish_reason == "length" and not sched.has_unfinished_requests()

    first = FakeWorker().next_token("b", [4, 5])  # stops on its first token
    sched.add_request(make_request("b", [4, 5], max_tokens=8, stop_token_ids=[first]))
    s2 = sched.schedule()
    s3 = sched.schedule()  # schedules the token after the stop token: dropped
    o2, o3 = worker.execute(s2), worker.execute(s3)
    out = sched.update_from_output(s2, o2)
    assert out[0].new_token_ids == [first] and out[0].finish_reason == "stop"
    assert sched.update_from_output(s3, o3) == []
    assert "b" in sched.schedule().finished_req_ids  # the worker forgets it
