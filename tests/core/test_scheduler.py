"""Scheduler: continuous batching, chunked prefill, prefix caching, preemption, stops.

``FakeWorker`` plays the stateful worker and model runner: it keeps per-request state from
the SchedulerOutput diffs exactly as the real worker must, "writes" each computed token
into a paged KV store at its slot, checks that every position a request attends to holds
the right token (so wrong prefix hits, evictions or block tables fail loudly), and samples
a deterministic next token from the token history.
"""
import random
from dataclasses import dataclass

import pytest
from scheduler_helpers import make_request
from scheduler_helpers import run_to_completion as drive

from halserve.request import Request, RequestStatus
from halserve.sampling_params import SamplingParams
from halserve.scheduler import Scheduler, SchedulerConfig
from halserve.scheduler_output import ModelRunnerOutput, SampleLogprobs

BS = 4


def default_next_token(req_id, tokens):
    return 1000 + (sum(tokens) * 31 + len(tokens)) % 997


@dataclass
class WorkerState:
    tokens: list
    num_computed: int
    block_ids: list


class FakeWorker:
    def __init__(self, block_size=BS, next_token=default_next_token, logprobs=False):
        self.block_size = block_size
        self.next_token = next_token
        self.logprobs = logprobs
        self.reqs: dict[str, WorkerState] = {}
        self.kv: dict[int, int] = {}  # slot -> token whose K/V sits there

    def slot(self, st, pos):
        return st.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, so):
        for req_id in so.finished_req_ids:
            self.reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} sent as new twice"
            self.reqs[new.req_id] = WorkerState(
                [*new.prompt_token_ids, *new.output_token_ids], new.num_computed_tokens, list(new.block_ids)
            )
        for cached in so.scheduled_cached_reqs:
            st = self.reqs[cached.req_id]
            assert st.num_computed == cached.num_computed_tokens
            st.block_ids += cached.new_block_ids
        assert sum(so.num_scheduled_tokens.values()) == so.total_num_scheduled_tokens
        # Write the whole step's K/V first, then "attend" (the backends' order).
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.reqs[req_id]
            assert n >= 1 and st.num_computed + n <= len(st.tokens)
            assert 0 not in st.block_ids, "the null block was handed out"
            for pos in range(st.num_computed, st.num_computed + n):
                self.kv[self.slot(st, pos)] = st.tokens[pos]
        req_ids, sampled, logprobs = [], [], []
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.reqs[req_id]
            st.num_computed += n
            context = [self.kv.get(self.slot(st, pos)) for pos in range(st.num_computed)]
            assert context == st.tokens[: st.num_computed], f"{req_id} would attend to wrong K/V"
            req_ids.append(req_id)
            if st.num_computed == len(st.tokens):
                tok = self.next_token(req_id, st.tokens)
                st.tokens.append(tok)
                sampled.append([tok])
                logprobs.append([SampleLogprobs(tok, -0.5, 1, [tok], [-0.5])] if self.logprobs else None)
            else:
                sampled.append([])
                logprobs.append(None)
        return ModelRunnerOutput(req_ids, sampled, logprobs)


def make_scheduler(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, prefix=True):
    return Scheduler(SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=BS,
        num_blocks=num_blocks,
        enable_prefix_caching=prefix,
    ))


def step(sched, worker):
    so = sched.schedule()
    return so, sched.update_from_output(so, worker.execute(so))


def run_to_completion(sched, worker, max_steps=1000):
    """Returns {req_id: (tokens, finish_reason, stop_reason)} and the list of SchedulerOutputs."""
    return drive(sched, worker, step, max_steps)


# -- basic flow -----------------------------------------------------------------------
def test_single_request_prefill_then_decode_then_length():
    sched, worker = make_scheduler(), FakeWorker()
    sched.add_request(make_request("a", range(10), max_tokens=3))
    so, outs = step(sched, worker)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["a"] and so.num_scheduled_tokens == {"a": 10}
    assert so.scheduled_new_reqs[0].block_ids == sched.kv_cache_manager.get_block_ids("a")
    assert len(outs) == 1 and len(outs[0].new_token_ids) == 1 and outs[0].finish_reason is None
    so, outs = step(sched, worker)
    assert so.scheduled_new_reqs == [] and so.num_scheduled_tokens == {"a": 1}
    assert so.scheduled_cached_reqs[0].num_computed_tokens == 10
    so, outs = step(sched, worker)
    assert outs[0].finish_reason == "length" and outs[0].stop_reason is None
    assert not sched.has_unfinished_requests() and sched.kv_cache_usage == 0.0
    so = sched.schedule()
    assert so.is_empty and so.finished_req_ids == {"a"}
    assert sched.schedule().finished_req_ids == set()  # reported once


def test_output_tokens_and_logprobs_reach_the_engine():
    sched, worker = make_scheduler(), FakeWorker(logprobs=True)
    sched.add_request(make_request("a", range(5), max_tokens=2))
    _, outs = step(sched, worker)
    assert outs[0].new_logprobs[0].token_id == outs[0].new_token_ids[0]


def test_from_engine_config_and_stats():
    from halserve.config import EngineConfig

    config = EngineConfig(model="m", max_num_seqs=3, max_num_batched_tokens=32, block_size=8, enable_prefix_caching=False)
    sched = Scheduler.from_engine_config(config, num_blocks=10, max_model_len=64)
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.block_size) == (3, 32, 8)
    assert sched.kv_cache_manager.num_usable_blocks == 9 and not sched.kv_cache_manager.enable_prefix_caching
    sched.add_request(make_request("a", range(5)))
    stats = sched.get_stats()
    assert (stats.num_waiting, stats.num_running, stats.kv_cache_usage) == (1, 0, 0.0)
    sched.schedule()
    stats = sched.get_stats()
    assert (stats.num_waiting, stats.num_running) == (0, 1) and stats.kv_cache_usage == pytest.approx(1 / 9)


# -- admission limits -------------------------------------------------------------------
def test_chunked_prefill_respects_budget_and_decodes_go_first():
    sched, worker = make_scheduler(max_num_batched_tokens=8), FakeWorker()
    sched.add_request(make_request("a", range(20), max_tokens=3))
    sched.add_request(make_request("b", range(100, 105), max_tokens=3))
    so, outs = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 8} and outs == []  # partial chunk: no token
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 8}
    so, outs = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 4, "b": 4}  # a's last chunk, b's first
    assert [o.request_id for o in outs] == ["a"]
    so, outs = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}  # a decodes, b finishes its prompt
    assert sorted(o.request_id for o in outs) == ["a", "b"]


def test_max_num_seqs_caps_running():
    sched, worker = make_scheduler(max_num_seqs=2), FakeWorker()
    for i in range(3):
        sched.add_request(make_request(f"r{i}", range(i * 10, i * 10 + 5), max_tokens=2 + i))
    so, _ = step(sched, worker)
    assert sorted(so.num_scheduled_tokens) == ["r0", "r1"] and sched.num_running == 2 and sched.num_waiting == 1
    so, _ = step(sched, worker)  # r0 finishes (2 tokens) during this step
    assert "r2" not in so.num_scheduled_tokens
    so, _ = step(sched, worker)
    assert "r2" in so.num_scheduled_tokens and [n.req_id for n in so.scheduled_new_reqs] == ["r2"]


def test_fcfs_head_blocks_later_requests():
    # 8 usable blocks. a holds 4; big needs 5 -> must wait; small (arrived later) must not overtake.
    sched, worker = make_scheduler(num_blocks=9), FakeWorker()
    sched.add_request(make_request("a", range(14), max_tokens=2))
    step(sched, worker)
    sched.add_request(make_request("big", range(100, 120), max_tokens=1))
    sched.add_request(make_request("small", range(200, 202), max_tokens=1))
    so, _ = step(sched, worker)
    assert list(so.num_scheduled_tokens) == ["a"]
    so = sched.schedule()  # a finished: big first, then small
    assert [n.req_id for n in so.scheduled_new_reqs] == ["big", "small"]


# -- prefix caching ---------------------------------------------------------------------
def test_prefix_hit_across_requests_reports_cached_tokens():
    sched, worker = make_scheduler(), FakeWorker()
    system = list(range(50, 62))  # 3 shared blocks
    sched.add_request(make_request("a", [*system, 1, 2], max_tokens=2))
    res_a, _ = run_to_completion(sched, worker)
    sched.add_request(make_request("b", [*system, 7], max_tokens=2))
    so, outs = step(sched, worker)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12 and so.num_scheduled_tokens == {"b": 1}
    assert outs[0].num_cached_tokens == 12
    run_to_completion(sched, worker)
    assert sched.prefix_cache_hits == 12 and sched.prefix_cache_queries == 14 + 13
    assert sched.kv_cache_usage == 0.0


def test_same_step_prefix_hit():
    sched, worker = make_scheduler(), FakeWorker()
    sched.add_request(make_request("a", range(13), max_tokens=2))
    sched.add_request(make_request("b", range(13), max_tokens=2))
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 13, "b": 1}
    assert so.scheduled_new_reqs[1].block_ids[:3] == so.scheduled_new_reqs[0].block_ids[:3]
    results, _ = run_to_completion(sched, worker)
    assert results["a"][0] == results["b"][0]  # worker checked b really saw a's K/V
    assert sched.kv_cache_usage == 0.0


def test_prefix_caching_disabled_recomputes():
    sched, worker = make_scheduler(prefix=False), FakeWorker()
    sched.add_request(make_request("a", range(13), max_tokens=2))
    sched.add_request(make_request("b", range(13), max_tokens=2))
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 13, "b": 13}
    assert sched.prefix_cache_queries == 0 and sched.prefix_cache_hits == 0


# -- preemption -------------------------------------------------------------------------
def test_preemption_by_recompute_and_resume_as_new_request():
    # 6 usable blocks = 24 tokens; each request needs up to 4 blocks (8 prompt + 8 out).
    sched, worker = make_scheduler(num_blocks=7), FakeWorker()
    sched.add_request(make_request("a", range(8), max_tokens=8))
    sched.add_request(make_request("b", range(100, 108), max_tokens=8))
    sched.add_request(make_request("c", range(200, 208), max_tokens=8))
    results, outputs = run_to_completion(sched, worker)
    assert sched.num_preemptions > 0
    preempting = [so for so in outputs if so.num_preempted]
    victim_ids = set().union(*(so.finished_req_ids for so in preempting))
    assert "a" not in victim_ids  # the earliest request is never the victim
    # The victim comes back as a new request carrying the tokens it had generated.
    resumed = [(i, n) for i, so in enumerate(outputs) for n in so.scheduled_new_reqs if n.output_token_ids]
    assert resumed and {n.req_id for _, n in resumed} <= victim_ids
    for _, n in resumed:
        assert results[n.req_id][0][: len(n.output_token_ids)] == n.output_token_ids
    assert all(len(toks) == 8 and reason == "length" for toks, reason, _ in results.values())
    assert sched.kv_cache_usage == 0.0


def test_request_being_scheduled_preempts_itself_when_it_is_last():
    # 4 usable blocks. After the prefills a (7 tokens) and b (8 tokens) hold 2 blocks each.
    # Next step a's decode (position 7) fits its block, b's (position 8) needs a new one:
    # the lowest-priority running request is b itself, so b is preempted, not looped on.
    sched, worker = make_scheduler(num_blocks=5), FakeWorker()
    a, b = make_request("a", range(7), max_tokens=9), make_request("b", range(100, 108), max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, worker)
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 1} and so.num_preempted == 1 and so.finished_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert list(sched.waiting) == [b]
    run_to_completion(sched, worker)
    assert len(a.output_token_ids) == 9 and len(b.output_token_ids) == 3
    assert a.finish_reason == b.finish_reason == "length"
    assert sched.kv_cache_usage == 0.0


def test_outputs_independent_of_scheduling_randomized():
    rng = random.Random(0)
    shared = [rng.randrange(500) for _ in range(12)]
    specs = []
    for i in range(12):
        prompt = shared[: rng.randrange(0, 13)] + [rng.randrange(500) for _ in range(rng.randrange(1, 12))]
        specs.append((f"r{i}", prompt, rng.randrange(1, 10)))

    def run(**kw):
        sched, worker = make_scheduler(**kw), FakeWorker()
        for req_id, prompt, max_tokens in specs:
            sched.add_request(make_request(req_id, prompt, max_tokens=max_tokens))
        results, _ = run_to_completion(sched, worker)
        assert sched.kv_cache_usage == 0.0
        return results, sched

    reference, _ = run(num_blocks=200, max_num_batched_tokens=512, prefix=False)
    tight, sched = run(num_blocks=9, max_num_seqs=4, max_num_batched_tokens=7)
    assert tight == reference
    assert sched.num_preemptions > 0 and sched.prefix_cache_hits > 0


# -- validation -------------------------------------------------------------------------
def test_too_large_request_raises():
    sched = make_scheduler(num_blocks=5)  # 4 usable blocks = 16 tokens
    with pytest.raises(ValueError, match=r"needs 20 tokens of KV cache .* holds 16 tokens.*num_kv_blocks"):
        sched.add_request(make_request("a", range(12), max_tokens=8))
    sched.add_request(make_request("b", range(12), max_tokens=4))  # exactly fits
    assert sched.num_waiting == 1


def test_request_validation():
    sched = make_scheduler(max_model_len=16)
    sched.add_request(make_request("a", range(4)))
    with pytest.raises(ValueError, match="'a' is already in use"):
        sched.add_request(make_request("a", range(4)))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(make_request("e", []))
    with pytest.raises(ValueError, match="17 tokens, longer than max_model_len=16"):
        sched.add_request(make_request("long", range(17)))
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        sched.add_request(Request("z", [1], SamplingParams(), max_tokens=0))
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        make_scheduler(max_num_seqs=0)
    with pytest.raises(ValueError, match="FINISHED_"):
        sched.finish_requests("a", RequestStatus.RUNNING)


# -- aborts -----------------------------------------------------------------------------
def test_abort_frees_blocks_running_and_waiting():
    sched, worker = make_scheduler(max_num_seqs=1), FakeWorker()
    sched.add_request(make_request("a", range(10), max_tokens=5))
    sched.add_request(make_request("b", range(20, 30), max_tokens=5))
    step(sched, worker)
    assert sched.kv_cache_usage > 0
    sched.abort_requests(["a", "b", "unknown"])
    assert not sched.has_unfinished_requests() and sched.kv_cache_usage == 0.0
    assert sched.num_running == 0 and sched.num_waiting == 0
    assert {"a", "b"} <= sched.schedule().finished_req_ids


def test_abort_during_step_is_ignored_by_update():
    sched, worker = make_scheduler(), FakeWorker()
    sched.add_request(make_request("a", range(5), max_tokens=5))
    sched.add_request(make_request("b", range(10, 15), max_tokens=5))
    so = sched.schedule()
    mro = worker.execute(so)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    outs = sched.update_from_output(so, mro)
    assert [o.request_id for o in outs] == ["b"]


def test_stop_string_finish_from_upstream():
    sched, worker = make_scheduler(), FakeWorker()
    req = make_request("a", range(5), max_tokens=5)
    sched.add_request(req)
    step(sched, worker)
    req.stop_reason = "###"
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert req.finish_reason == "stop" and sched.kv_cache_usage == 0.0


# -- stop conditions ---------------------------------------------------------------------
def scripted(tokens):
    """A worker that emits ``tokens`` in order, whatever the context."""
    it = iter(tokens)
    return FakeWorker(next_token=lambda req_id, ctx: next(it))


def run_one(request, tokens, max_model_len=128):
    sched = make_scheduler(max_model_len=max_model_len)
    sched.add_request(request)
    results, _ = run_to_completion(sched, scripted(tokens))
    assert sched.kv_cache_usage == 0.0
    return results[request.request_id], request


def test_eos_stops_and_is_kept():
    (toks, reason, stop_reason), req = run_one(make_request("a", [1, 2], max_tokens=10, eos={7}), [5, 7, 9])
    assert toks == [5, 7] and reason == "stop" and stop_reason is None
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos():
    req = make_request("a", [1, 2], max_tokens=3, eos={7}, ignore_eos=True)
    (toks, reason, _), _ = run_one(req, [7, 7, 7, 7])
    assert toks == [7, 7, 7] and reason == "length"


def test_stop_token_ids_set_stop_reason():
    req = make_request("a", [1, 2], max_tokens=10, stop_token_ids=[42])
    (toks, reason, stop_reason), _ = run_one(req, [5, 42, 9])
    assert toks == [5, 42] and reason == "stop" and stop_reason == 42


def test_min_tokens_holds_off_eos_and_stop_ids():
    req = make_request("a", [1, 2], max_tokens=10, eos={7}, min_tokens=3, stop_token_ids=[42])
    (toks, reason, stop_reason), _ = run_one(req, [7, 42, 7, 8])
    assert toks == [7, 42, 7] and reason == "stop" and stop_reason is None


def test_max_tokens_and_max_model_len():
    (toks, reason, _), _ = run_one(make_request("a", [1, 2], max_tokens=3), [4, 5, 6, 7])
    assert toks == [4, 5, 6] and reason == "length"
    (toks, reason, _), _ = run_one(make_request("b", range(6), max_tokens=20), range(300, 320), max_model_len=8)
    assert toks == [300, 301] and reason == "length"
