"""Driving a ``Scheduler`` with a fake worker (no model), for the scheduler tests.

``make_request(req_id, prompt, max_tokens=4, eos=(), **sampling_params)``: a ``Request`` as the
engine would build it.

``run_to_completion(sched, worker, step, max_steps)`` runs ``step(sched, worker) ->
(SchedulerOutput, outputs)`` until every request finished, checks each step's budget and
batch size, and returns ``({req_id: (tokens, finish_reason, stop_reason)}, [SchedulerOutput])``.
"""
from __future__ import annotations

from halserve.request import Request
from halserve.sampling_params import SamplingParams


def make_request(req_id, prompt, max_tokens=4, eos=(), **params) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        max_tokens=max_tokens,
        eos_token_ids=set(eos),
    )


def run_to_completion(sched, worker, step, max_steps: int = 1000):
    results, outputs = {}, []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so, outs = step(sched, worker)
        outputs.append(so)
        assert so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= sched.max_num_seqs
        for o in outs:
            toks, _, _ = results.get(o.request_id, ([], None, None))
            results[o.request_id] = (toks + o.new_token_ids, o.finish_reason, o.stop_reason)
    assert not sched.has_unfinished_requests(), "did not finish"
    return results, outputs
