"""Speculative decoding in the Scheduler, driven by a fake worker (no model).

``SpecWorker`` plays the worker and model runner the way the real ones must behave with
drafts: it keeps per-request state from the SchedulerOutput diffs, writes every fed token
(the last real token *and* the drafts) into a paged KV store at its slot, checks that each
position a request attends to holds the right token (so a rejected draft's stale K/V that
the scheduler wrongly counts as computed, or caches as a prefix block, fails loudly), and
"samples" at every draft position with a deterministic true-next-token function: drafts are
accepted while they equal what it would have generated, then one more token (the first
mismatch, or a bonus token).

Since that function depends only on the real token history, a scheduler with speculation
must produce exactly the tokens of one without.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from scheduler_helpers import make_request as base_request
from scheduler_helpers import run_to_completion as drive

from halserve.request import RequestStatus
from halserve.scheduler import Scheduler, SchedulerConfig
from halserve.scheduler_output import ModelRunnerOutput, SampleLogprobs
from halserve.spec_decode import NgramProposer, count_accepted

BS = 4

# A small alphabet and a fixed successor map: greedy-like "models" that fall into cycles, so
# prompt lookup finds n-grams that recur and drafts get accepted.
ALPHABET = list(range(10, 22))
_ORDER = random.Random(1234).sample(ALPHABET, len(ALPHABET))
SUCCESSOR = {a: b for a, b in zip(_ORDER, _ORDER[1:] + _ORDER[:1])}  # one cycle through all 12


def cyclic_next(req_id, tokens):
    """Continues the successor map: drafts from an earlier occurrence are always right."""
    return SUCCESSOR.get(tokens[-1], ALPHABET[0])


def noisy_next(req_id, tokens):
    """Mostly the successor map, but every 5th position something that depends on the whole
    history: drafts are sometimes accepted, sometimes rejected part-way."""
    if len(tokens) % 5 == 0:
        return ALPHABET[(sum(tokens) * 7 + len(tokens)) % len(ALPHABET)]
    return SUCCESSOR.get(tokens[-1], ALPHABET[0])


def period2_next(req_id, tokens):
    """Repeats the last two tokens (a b a b ...)."""
    return tokens[-2] if len(tokens) > 1 else tokens[-1]


def cycle_from(start, length):
    out = [start]
    while len(out) < length:
        out.append(SUCCESSOR[out[-1]])
    return out


@dataclass
class WorkerState:
    tokens: list
    num_computed: int
    block_ids: list


@dataclass
class DraftRecord:
    req_id: str
    pos: int  # the position of the first draft in the request's sequence
    drafts: list
    sampled: list  # what the worker returned: accepted drafts + one more

    @property
    def num_accepted(self):
        return count_accepted(self.drafts, self.sampled)


@dataclass
class SpecWorker:
    next_token: object = noisy_next
    block_size: int = BS
    logprobs: bool = False
    reqs: dict = field(default_factory=dict)
    kv: dict = field(default_factory=dict)  # slot -> token whose K/V sits there
    records: list = field(default_factory=list)  # one DraftRecord per (step, request) with drafts
    num_sample_events: int = 0  # (step, request) pairs that returned tokens

    def slot(self, st, pos):
        index = pos // self.block_size
        assert index < len(st.block_ids), f"position {pos} has no block (table of {len(st.block_ids)})"
        return st.block_ids[index] * self.block_size + pos % self.block_size

    def execute(self, so):
        for req_id in so.finished_req_ids:
            self.reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} sent as new twice"
            assert new.req_id not in so.scheduled_spec_decode_tokens, "a new/resumed request got drafts"
            self.reqs[new.req_id] = WorkerState(
                [*new.prompt_token_ids, *new.output_token_ids], new.num_computed_tokens, list(new.block_ids)
            )
        for cached in so.scheduled_cached_reqs:
            st = self.reqs[cached.req_id]
            assert st.num_computed == cached.num_computed_tokens, (
                f"{cached.req_id}: scheduler says {cached.num_computed_tokens} computed, worker has {st.num_computed}")
            st.block_ids += cached.new_block_ids
        assert sum(so.num_scheduled_tokens.values()) == so.total_num_scheduled_tokens
        assert set(so.scheduled_spec_decode_tokens) <= set(so.num_scheduled_tokens)
        # Write the whole step's K/V first (drafts included), then "attend".
        fed = {}
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.reqs[req_id]
            drafts = list(so.scheduled_spec_decode_tokens.get(req_id, ()))
            num_real = n - len(drafts)
            assert num_real >= 1 and st.num_computed + num_real <= len(st.tokens)
            if drafts:
                assert st.num_computed + 1 == len(st.tokens), f"{req_id}: drafts for a request that is not decoding"
                # drafts' slots must be the request's own: never a block another request holds
                others = {b for other_id, o in self.reqs.items() if other_id != req_id for b in o.block_ids}
                for pos in range(len(st.tokens), len(st.tokens) + len(drafts)):
                    assert st.block_ids[pos // self.block_size] not in others, f"{req_id}: draft into a shared block"
            assert 0 not in st.block_ids, "the null block was handed out"
            fed[req_id] = st.tokens[st.num_computed: st.num_computed + num_real] + drafts
            for i, tok in enumerate(fed[req_id]):
                self.kv[self.slot(st, st.num_computed + i)] = tok
        req_ids, sampled, logprobs = [], [], []
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.reqs[req_id]
            drafts = list(so.scheduled_spec_decode_tokens.get(req_id, ()))
            end = st.num_computed + n
            context = [self.kv.get(self.slot(st, pos)) for pos in range(end)]
            assert context == (st.tokens[: st.num_computed] + fed[req_id]), f"{req_id} would attend to wrong K/V"
            req_ids.append(req_id)
            num_real = n - len(drafts)
            if st.num_computed + num_real == len(st.tokens):
                out = []
                for j in range(len(drafts) + 1):
                    tok = self.next_token(req_id, st.tokens + drafts[:j])
                    out.append(tok)
                    if j == len(drafts) or tok != drafts[j]:
                        break
                if drafts:
                    self.records.append(DraftRecord(req_id, len(st.tokens), drafts, list(out)))
                st.num_computed += num_real + count_accepted(drafts, out)
                st.tokens.extend(out)
                self.num_sample_events += 1
                sampled.append(out)
                logprobs.append([SampleLogprobs(t, -0.25 * (i + 1), 1, [t], [-0.25 * (i + 1)]) for i, t in
                                 enumerate(out)] if self.logprobs else None)
            else:
                st.num_computed += n
                sampled.append([])
                logprobs.append(None)
        return ModelRunnerOutput(req_ids, sampled, logprobs)


def make_scheduler(k=3, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, prefix=True,
                   min_n=1, max_n=3, block_size=BS):
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=prefix,
        ),
        spec_proposer=None if not k else NgramProposer(min_n, max_n, k),
    )


def make_request(req_id, prompt, max_tokens=8, eos=(), **params):
    return base_request(req_id, prompt, max_tokens, eos, **params)


def check_schedule(sched, so):
    """What every SchedulerOutput with drafts must satisfy (before the step runs)."""
    proposer = sched.spec_proposer
    for req_id, drafts in so.scheduled_spec_decode_tokens.items():
        request = sched.get_request(req_id)
        assert drafts, f"{req_id}: an empty draft list was sent"
        assert proposer is not None
        assert request.num_tokens - request.num_computed_tokens == 1, f"{req_id}: drafts for a prefill"
        assert so.num_scheduled_tokens[req_id] == 1 + len(drafts)
        assert len(drafts) <= proposer.num_speculative_tokens
        assert len(drafts) <= request.max_tokens - request.num_output_tokens - 1, f"{req_id}: past max_tokens"
        assert len(drafts) <= sched.max_model_len - request.num_tokens, f"{req_id}: past max_model_len"
        # (the proposal depends on the cap the scheduler passed: len(drafts) .. k)
        proposals = [proposer.propose(request.all_token_ids, cap)
                     for cap in range(len(drafts), proposer.num_speculative_tokens + 1)]
        if request.grammar is None:
            assert drafts in proposals, f"{req_id}: not the proposal"
        else:  # cut where its grammar refuses a draft
            assert not request.grammar.waits and any(p[: len(drafts)] == drafts for p in proposals), req_id


def step(sched, worker):
    so = sched.schedule()
    check_schedule(sched, so)
    outs = sched.update_from_output(so, worker.execute(so))
    for req_id in so.scheduled_spec_decode_tokens:
        request = sched.get_request(req_id)
        if request is not None:  # still running: rejected drafts rolled back
            assert request.num_tokens - request.num_computed_tokens == 1, (
                f"{req_id}: {request.num_tokens} tokens, {request.num_computed_tokens} computed after a spec step")
    return so, outs


def run_to_completion(sched, worker, max_steps=2000):
    """{req_id: (tokens, finish_reason, stop_reason)} and the list of SchedulerOutputs."""
    results, outputs = drive(sched, worker, step, max_steps)
    assert sched.kv_cache_usage == 0.0
    return results, outputs


def run_requests(requests, worker_fn=noisy_next, **kw):
    sched = make_scheduler(**kw)
    worker = SpecWorker(next_token=worker_fn, block_size=sched.block_size)
    for request in requests():
        sched.add_request(request)
    results, outputs = run_to_completion(sched, worker)
    return results, outputs, sched, worker


def assert_stats_match(sched, worker):
    stats = sched.get_stats()
    assert stats.spec_num_drafts == len(worker.records)
    assert stats.spec_num_draft_tokens == sum(len(r.drafts) for r in worker.records)
    assert stats.spec_num_accepted_tokens == sum(r.num_accepted for r in worker.records)
    assert 0 <= stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert stats.spec_num_drafts <= stats.spec_num_draft_tokens


# -- where drafts go -----------------------------------------------------------------------
def test_drafts_only_for_decodes_and_counted_in_scheduled_tokens():
    sched, worker = make_scheduler(k=3, max_num_batched_tokens=8), SpecWorker(next_token=cyclic_next)
    prompt = cycle_from(ALPHABET[0], 20)  # the cycle recurs within the prompt
    sched.add_request(make_request("a", prompt, max_tokens=12))
    so, outs = step(sched, worker)  # chunked prefill: no drafts
    assert so.num_scheduled_tokens == {"a": 8} and so.scheduled_spec_decode_tokens == {} and outs == []
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 8} and so.scheduled_spec_decode_tokens == {}
    so, outs = step(sched, worker)  # last chunk, samples the first token; no drafts yet
    assert so.num_scheduled_tokens == {"a": 4} and so.scheduled_spec_decode_tokens == {}
    assert len(outs[0].new_token_ids) == 1
    sched.add_request(make_request("b", cycle_from(ALPHABET[3], 6), max_tokens=4))
    so, outs = step(sched, worker)  # a decodes with 3 drafts (all right: +3 +1 bonus); b prefills
    drafts = so.scheduled_spec_decode_tokens["a"]
    assert len(drafts) == 3 and "b" not in so.scheduled_spec_decode_tokens
    assert so.num_scheduled_tokens == {"a": 4, "b": 4}  # b's prompt cut by the budget left (8 - 4)
    assert so.total_num_scheduled_tokens == 8
    by_id = {o.request_id: o for o in outs}
    assert by_id["a"].new_token_ids == [*drafts, SUCCESSOR[drafts[-1]]]
    assert "b" not in by_id  # a partial chunk
    results, _ = run_to_completion(sched, worker)
    assert len(results["a"][0]) == 12 - 5 and results["a"][1] == "length"  # the tokens after the first 5
    assert_stats_match(sched, worker)
    assert sched.get_stats().spec_num_accepted_tokens > 0


def test_no_drafts_without_a_proposer_or_a_recurring_ngram():
    sched, worker = make_scheduler(k=0), SpecWorker(next_token=cyclic_next)
    sched.add_request(make_request("a", cycle_from(ALPHABET[0], 20), max_tokens=6))
    _, outputs = run_to_completion(sched, worker)
    assert all(so.scheduled_spec_decode_tokens == {} for so in outputs) and len(outputs) == 6
    assert sched.get_stats().spec_num_drafts == 0
    # a history where nothing recurs: nothing proposed, one token per step
    sched, worker = make_scheduler(k=3), SpecWorker(next_token=lambda r, t: 500 + len(t))
    sched.add_request(make_request("b", range(100, 110), max_tokens=5))
    _, outputs = run_to_completion(sched, worker)
    assert all(so.scheduled_spec_decode_tokens == {} for so in outputs) and len(outputs) == 5


def test_full_acceptance_emits_k_plus_one_tokens_per_step():
    sched, worker = make_scheduler(k=4), SpecWorker(next_token=cyclic_next)
    prompt = cycle_from(ALPHABET[5], 14)
    req = make_request("a", prompt, max_tokens=21)
    sched.add_request(req)
    results, outputs = run_to_completion(sched, worker)
    # prefill: 1 token; then 4 steps of 4 drafts + 1 bonus = 20 tokens
    assert [len(so.scheduled_spec_decode_tokens.get("a", ())) for so in outputs] == [0, 4, 4, 4, 4]
    toks, reason, _ = results["a"]
    assert toks == cycle_from(SUCCESSOR[prompt[-1]], 21) and reason == "length"
    stats = sched.get_stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (4, 16, 16)


# -- caps ------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 5, 7, 10])
def test_drafts_capped_by_max_tokens(max_tokens):
    sched, worker = make_scheduler(k=4), SpecWorker(next_token=cyclic_next)
    prompt = cycle_from(ALPHABET[2], 15)
    sched.add_request(make_request("a", prompt, max_tokens=max_tokens))
    results, outputs = run_to_completion(sched, worker)
    drafts = [len(so.scheduled_spec_decode_tokens.get("a", ())) for so in outputs]
    # every step proposes as much as max_tokens leaves after the bonus token (the cycle recurs)
    expect, produced = [0], 1
    while produced < max_tokens:
        expect.append(min(4, max_tokens - produced - 1))
        produced += expect[-1] + 1
    assert drafts == expect
    toks, reason, _ = results["a"]
    assert len(toks) == max_tokens and reason == "length"
    assert toks == cycle_from(SUCCESSOR[prompt[-1]], max_tokens)
    # the worker never generated past max_tokens either: no draft was spent beyond it
    assert len(worker.reqs["a"].tokens) == len(prompt) + max_tokens


@pytest.mark.parametrize("max_model_len", [16, 17, 18, 19, 20, 23])
def test_drafts_capped_by_max_model_len(max_model_len):
    # (a draft past max_model_len would trip the KV manager's assertion or the worker's table)
    sched, worker = make_scheduler(k=5, max_model_len=max_model_len), SpecWorker(next_token=cyclic_next)
    prompt = cycle_from(ALPHABET[7], 13)
    req = make_request("a", prompt, max_tokens=100)
    sched.add_request(req)
    results, outputs = run_to_completion(sched, worker)
    toks, reason, _ = results["a"]
    assert len(prompt) + len(toks) == max_model_len and reason == "length"
    assert toks == cycle_from(SUCCESSOR[prompt[-1]], max_model_len - len(prompt))
    assert any(so.scheduled_spec_decode_tokens for so in outputs)
    # the last spec step used all the room there was: drafts up to position max_model_len - 1
    last = [so for so in outputs if so.scheduled_spec_decode_tokens][-1]
    n = last.scheduled_cached_reqs[0].num_computed_tokens + last.num_scheduled_tokens["a"]
    assert n <= max_model_len


def test_drafts_capped_by_token_budget():
    sched, worker = make_scheduler(k=6, max_num_batched_tokens=4), SpecWorker(next_token=cyclic_next)
    sched.add_request(make_request("a", cycle_from(ALPHABET[1], 4), max_tokens=30))
    results, outputs = run_to_completion(sched, worker)
    drafted = [so.scheduled_spec_decode_tokens.get("a", []) for so in outputs]
    assert max(len(d) for d in drafted) == 3  # budget 4 - its own token
    assert all(so.total_num_scheduled_tokens <= 4 for so in outputs)
    assert len(results["a"][0]) == 30


def test_budget_shared_by_several_decodes():
    # budget 6: a (earliest) takes 1 + 3 drafts, b gets the 2 left: 1 + 1 draft
    sched, worker = make_scheduler(k=3, max_num_batched_tokens=6), SpecWorker(next_token=cyclic_next)
    sched.add_request(make_request("a", cycle_from(ALPHABET[0], 15), max_tokens=20))
    sched.add_request(make_request("b", [SUCCESSOR[10], 10], max_tokens=20))  # recurs once b samples
    results, outputs = run_to_completion(sched, worker)
    assert all(so.total_num_scheduled_tokens <= 6 for so in outputs)
    cut = [so for so in outputs if len(so.scheduled_spec_decode_tokens.get("a", ())) == 3
           and "b" in so.scheduled_spec_decode_tokens]
    assert cut, "a should have taken 3 drafts while b decoded too"
    for so in cut:
        assert so.num_scheduled_tokens == {"a": 4, "b": 2} and len(so.scheduled_spec_decode_tokens["b"]) == 1
    assert [len(results[r][0]) for r in "ab"] == [20, 20]
    assert_stats_match(sched, worker)


# -- rejection and stops -------------------------------------------------------------------
def test_rejected_drafts_roll_back_computed_tokens():
    # the true continuation follows the cycle except at one position: drafts proposed there
    # are rejected part-way, and the tokens must still be the true ones
    prompt = cycle_from(ALPHABET[0], 14)
    deviation = len(prompt) + 3  # the history length at which the "model" deviates once

    def next_token(req_id, tokens):
        if len(tokens) == deviation:
            return 99
        return SUCCESSOR.get(tokens[-1], ALPHABET[0])

    sched, worker = make_scheduler(k=5), SpecWorker(next_token=next_token)
    req = make_request("a", prompt, max_tokens=20)
    sched.add_request(req)
    results, outputs = run_to_completion(sched, worker)
    partial = [r for r in worker.records if 0 < r.num_accepted < len(r.drafts)]
    rejected = [r for r in worker.records if r.num_accepted < len(r.drafts)]
    assert partial and rejected, "the deviation should reject drafts part-way"
    # reference: the same history generated one token at a time
    ref = list(prompt)
    while len(ref) < len(prompt) + 20:
        ref.append(next_token("a", ref))
    assert results["a"][0] == ref[len(prompt):]
    assert 99 in results["a"][0]
    assert_stats_match(sched, worker)


def test_stop_token_among_accepted_drafts_ends_the_request_there():
    prompt = cycle_from(ALPHABET[0], 12)  # the cycle has 12 distinct tokens: it repeats from here
    cont = cycle_from(SUCCESSOR[prompt[-1]], 10)
    # first step: cont[0]; next step drafts cont[1:5] all right; stop on cont[2] (a draft)
    for kind in ("stop_token_ids", "eos"):
        sched, worker = make_scheduler(k=4), SpecWorker(next_token=cyclic_next)
        if kind == "eos":
            req = make_request("a", prompt, max_tokens=10, eos={cont[2]})
        else:
            req = make_request("a", prompt, max_tokens=10, stop_token_ids=[cont[2]])
        sched.add_request(req)
        results, outputs = run_to_completion(sched, worker)
        assert outputs[1].scheduled_spec_decode_tokens == {"a": cont[1:5]}
        assert worker.records[0].sampled == cont[1:6]  # the worker accepted past the stop token ...
        toks, reason, stop_reason = results["a"]
        assert toks == cont[:3] and reason == "stop"  # ... the scheduler ends right at it
        assert stop_reason == (cont[2] if kind == "stop_token_ids" else None)
        assert req.output_token_ids == cont[:3]


def test_min_tokens_holds_off_a_stop_token_among_drafts():
    prompt = cycle_from(ALPHABET[0], 12)
    cont = cycle_from(SUCCESSOR[prompt[-1]], 20)
    sched, worker = make_scheduler(k=4), SpecWorker(next_token=cyclic_next)
    # the stop token comes at output 2 (a draft) and again at 14; min_tokens=5 lets only the second count
    sched.add_request(make_request("a", prompt, max_tokens=20, stop_token_ids=[cont[2]], min_tokens=5))
    results, _ = run_to_completion(sched, worker)
    assert results["a"][0] == cont[:15] and results["a"][1:] == ("stop", cont[2])


def test_logprobs_follow_the_emitted_tokens():
    sched = make_scheduler(k=4)
    worker = SpecWorker(next_token=cyclic_next, logprobs=True)
    prompt = cycle_from(ALPHABET[0], 12)
    cont = cycle_from(SUCCESSOR[prompt[-1]], 10)
    sched.add_request(make_request("a", prompt, max_tokens=10, stop_token_ids=[cont[2]]))
    so = sched.schedule()
    outs = sched.update_from_output(so, worker.execute(so))
    assert [e.token_id for e in outs[0].new_logprobs] == outs[0].new_token_ids == cont[:1]
    so = sched.schedule()
    outs = sched.update_from_output(so, worker.execute(so))  # 4 drafts, 5 sampled, 2 kept (stop)
    assert outs[0].new_token_ids == cont[1:3]
    assert [e.token_id for e in outs[0].new_logprobs] == cont[1:3]


# -- prefix caching ---------------------------------------------------------------------------
def test_prefix_cache_holds_real_tokens_only():
    """A finished spec request's blocks (some of whose slots once held rejected drafts) are hit
    by a request continuing its real tokens, never by one continuing a rejected draft."""
    prompt = cycle_from(ALPHABET[0], 14)

    def next_token(req_id, tokens):  # deviates from the cycle at a few positions
        if len(tokens) in (17, 23, 30):
            return 90 + len(tokens) % 7
        return SUCCESSOR.get(tokens[-1], ALPHABET[0])

    sched, worker = make_scheduler(k=4), SpecWorker(next_token=next_token)
    sched.add_request(make_request("a", prompt, max_tokens=24))
    results, outputs = run_to_completion(sched, worker)
    real = prompt + results["a"][0]
    a_records = list(worker.records)
    rejected = [r for r in a_records if r.num_accepted < len(r.drafts)]
    assert rejected and sched.get_stats().spec_num_accepted_tokens > 0
    # (a) the real history is cached: all full blocks computed before a's last step
    last_computed = outputs[-1].scheduled_cached_reqs[0].num_computed_tokens + 1
    sched.add_request(make_request("b", real + [50], max_tokens=2))
    so, outs = step(sched, worker)  # the worker checks b attends to the right K/V
    hit = so.scheduled_new_reqs[0].num_computed_tokens
    assert hit >= (last_computed // BS) * BS and hit % BS == 0 and hit <= len(real)
    assert outs == [] or outs[0].num_cached_tokens == hit
    run_to_completion(sched, worker)
    # (b) for each rejected draft: a prompt that follows the draft instead of the real token
    # must not hit the block where that draft was written
    checked = 0
    for i, record in enumerate(rejected):
        assert real[record.pos: record.pos + len(record.sampled)] == record.sampled
        bad = record.pos + record.num_accepted  # first rejected draft's position
        fake = real[:bad] + record.drafts[record.num_accepted:]
        fake += [60 + j for j in range(BS)]  # so the draft's block is full and not the last
        assert fake[bad] != real[bad]
        sched.add_request(make_request(f"c{i}", fake, max_tokens=1))
        so, _ = step(sched, worker)  # the worker checks the context against the real K/V store
        hit = so.scheduled_new_reqs[0].num_computed_tokens
        assert hit <= (bad // BS) * BS, f"hit {hit} tokens, past the rejected draft at {bad}"
        run_to_completion(sched, worker)
        checked += 1
    assert checked >= 2


def test_prefix_hit_in_the_same_step_as_a_spec_decode():
    """b arrives while a decodes with drafts and shares a's full real blocks in the same step."""
    prompt = cycle_from(ALPHABET[0], 13)
    sched, worker = make_scheduler(k=3), SpecWorker(next_token=cyclic_next)
    sched.add_request(make_request("a", prompt, max_tokens=10))
    step(sched, worker)
    sched.add_request(make_request("b", prompt + [77], max_tokens=3))
    so, outs = step(sched, worker)
    assert so.scheduled_spec_decode_tokens.get("a")
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12  # a's 3 full prompt blocks
    assert [o.request_id for o in outs] == ["a", "b"] and outs[1].num_cached_tokens == 12
    results, _ = run_to_completion(sched, worker)
    assert len(outs[1].new_token_ids + results["b"][0]) == 3


# -- memory pressure -----------------------------------------------------------------------------
def test_drafts_dropped_before_preemption_when_blocks_are_short():
    # 4 usable blocks. a and b (7 prompt tokens each) take 2 blocks each; their next token (position
    # 7) fits, drafts (positions 8..) would need a third block each: drafts are dropped, nobody is
    # preempted. The step after, a needs a block for position 8 and b is preempted.
    sched, worker = make_scheduler(k=3, num_blocks=5), SpecWorker(next_token=period2_next)
    a = make_request("a", [10, 11, 10, 11, 10, 11, 10], max_tokens=5)
    b = make_request("b", [12, 13, 12, 13, 12, 13, 12], max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, worker)
    assert sched.kv_cache_manager.get_num_free_blocks() == 0
    assert sched.spec_proposer.propose(a.all_token_ids) and sched.spec_proposer.propose(b.all_token_ids)
    so, _ = step(sched, worker)
    assert so.num_preempted == 0 and so.scheduled_spec_decode_tokens == {}
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    so, _ = step(sched, worker)
    assert so.num_preempted == 1 and so.finished_req_ids == {"b"} and b.status == RequestStatus.PREEMPTED
    results, outputs = run_to_completion(sched, worker)
    assert len(a.output_token_ids) == 5 and len(b.output_token_ids) == 5
    # with the cache to itself a gets drafts again
    assert any(so.scheduled_spec_decode_tokens for so in outputs)


def test_drafts_given_up_only_by_the_request_short_of_blocks():
    # 6 usable blocks, all taken after the prefills: a's drafts (positions 6, 7) fit its partial
    # block, b's (positions 16..) would need a new one that is not there
    sched, worker = make_scheduler(k=2, num_blocks=7), SpecWorker(next_token=period2_next)
    a = make_request("a", [10, 11, 10, 11, 10], max_tokens=4)
    b = make_request("b", [12, 13] * 7 + [12], max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, worker)
    assert sched.kv_cache_manager.get_num_free_blocks() == 0
    assert sched.spec_proposer.propose(b.all_token_ids)
    so, outs = step(sched, worker)
    assert so.scheduled_spec_decode_tokens == {"a": [10, 11]} and so.num_scheduled_tokens == {"a": 3, "b": 1}
    assert so.num_preempted == 0
    assert outs[0].new_token_ids == [10, 11, 10] and outs[0].finish_reason == "length"  # 1 + 2 + 1 = max_tokens
    run_to_completion(sched, worker)
    assert a.output_token_ids == [11, 10, 11, 10] and b.output_token_ids == [13, 12, 13, 12]


# -- randomized equivalence ---------------------------------------------------------------------
def random_workload(seed, n=10):
    rng = random.Random(seed)
    shared = [rng.choice(ALPHABET) for _ in range(9)]
    specs = []
    for i in range(n):
        prompt = shared[: rng.randrange(0, 10)] + [rng.choice(ALPHABET + [40, 41]) for _ in range(rng.randrange(1, 14))]
        params = dict(max_tokens=rng.randrange(1, 22))
        r = rng.random()
        if r < 0.2:
            params["stop_token_ids"] = [rng.choice(ALPHABET)]
        elif r < 0.35:
            params["eos"] = {rng.choice(ALPHABET)}
            params["min_tokens"] = rng.randrange(0, 6)
        specs.append((f"r{i}", prompt, params))

    def requests():
        return [make_request(req_id, prompt, **dict(params)) for req_id, prompt, params in specs]

    return requests


CONFIGS = [
    dict(k=1),
    dict(k=3, max_n=2),
    dict(k=5, min_n=2, max_n=4),
    dict(k=4, num_blocks=12, max_num_seqs=4, max_num_batched_tokens=9),  # preemption + budget cuts
    dict(k=3, num_blocks=10, max_num_batched_tokens=7, prefix=False),
    dict(k=6, max_model_len=24, block_size=8),
    dict(k=2, num_blocks=20, max_num_seqs=3, max_num_batched_tokens=5, block_size=2),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("config", CONFIGS, ids=[str(i) for i in range(len(CONFIGS))])
def test_outputs_identical_with_and_without_speculation(seed, config):
    requests = random_workload(seed)
    base_kw = {key: value for key, value in config.items() if key not in ("k", "min_n", "max_n")}
    want, _, _, _ = run_requests(requests, k=0, **base_kw)
    got, outputs, sched, worker = run_requests(requests, **config)
    assert got == want
    assert_stats_match(sched, worker)
    stats = sched.get_stats()
    assert stats.spec_num_accepted_tokens > 0, "the workload should accept some drafts"
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens, "... and reject some"
    assert any(so.scheduled_spec_decode_tokens for so in outputs)


def test_token_accounting_without_stops():
    """Requests that end by length only: every output token is either one per sampling step
    or an accepted draft."""
    rng = random.Random(5)
    specs = [(f"r{i}", [rng.choice(ALPHABET) for _ in range(rng.randrange(2, 15))], rng.randrange(1, 25))
             for i in range(8)]

    def requests():
        return [make_request(req_id, prompt, max_tokens=m) for req_id, prompt, m in specs]

    results, _, sched, worker = run_requests(requests, k=4, num_blocks=14, max_num_batched_tokens=10)
    stats = sched.get_stats()
    assert_stats_match(sched, worker)
    total = sum(len(toks) for toks, _, _ in results.values())
    assert total == sum(m for _, _, m in specs)
    assert total == worker.num_sample_events + stats.spec_num_accepted_tokens
    assert stats.spec_num_accepted_tokens > 0 and sched.num_preemptions > 0


# -- requests that never get drafts ------------------------------------------------------------------
class _Grammar:
    """Stands in for a structured-output matcher: allows any token but ``refused`` ones;
    ``waits``: its constraint has not started (a start_after marker)."""

    masks = True
    gated = False

    def __init__(self, waits=False, refused=()):
        self.waits = waits
        self.refused = set(refused)

    def valid_prefix(self, drafts):
        cut = next((i for i, t in enumerate(drafts) if t in self.refused), len(drafts))
        return drafts[:cut]

    def follow(self, token_id, output_token_ids):
        return True


def test_grammar_requests_get_only_the_drafts_their_grammar_allows():
    from halserve.pooling_params import PoolingParams

    sched, worker = make_scheduler(k=3), SpecWorker(next_token=cyclic_next)
    prompt = cycle_from(ALPHABET[0], 12)
    plain = make_request("plain", prompt, max_tokens=12)
    waiting = make_request("g", prompt, max_tokens=12)
    refusing = make_request("h", prompt, max_tokens=12)
    for request in (plain, waiting, refusing):
        sched.add_request(request)
    waiting.grammar = _Grammar(waits=True)
    refused = SUCCESSOR[SUCCESSOR[prompt[-1]]]  # the second token of the cycle after the prompt
    refusing.grammar = _Grammar(refused={refused})
    results, outputs = run_to_completion(sched, worker)
    assert any("plain" in so.scheduled_spec_decode_tokens for so in outputs)
    assert not any("g" in so.scheduled_spec_decode_tokens for so in outputs)  # no masks yet: no drafts
    h_drafts = [so.scheduled_spec_decode_tokens["h"] for so in outputs if "h" in so.scheduled_spec_decode_tokens]
    assert h_drafts and all(refused not in d for d in h_drafts)
    assert any(len(d) < 3 for d in h_drafts)  # cut before the refused token
    assert results["g"][0] == results["h"][0] == results["plain"][0]
    assert sum(1 for so in outputs if "g" in so.num_scheduled_tokens) == 12  # one token per step
    # a pooling request, were it ever to decode, is not drafted for
    pooled = make_request("p", prompt, max_tokens=8)
    pooled.sampling_params.pooling = PoolingParams()
    pooled.append_output_token_id(11)
    pooled.num_computed_tokens = pooled.num_tokens - 1
    assert sched.spec_proposer.propose(pooled.all_token_ids)
    assert sched._propose_drafts(pooled, 64) == []


def test_no_drafts_in_steps_running_disable_by_batch_size_requests():
    sched = make_scheduler(k=3)
    sched.spec_proposer = NgramProposer(1, 3, 3, disable_by_batch_size=2)
    worker = SpecWorker(next_token=cyclic_next)
    sched.add_request(make_request("a", cycle_from(ALPHABET[0], 12), max_tokens=14))
    sched.add_request(make_request("b", cycle_from(ALPHABET[2], 12), max_tokens=4))
    drafted = []
    while sched.has_unfinished_requests():
        num_running = sched.num_running
        so, _ = step(sched, worker)
        drafted.append((num_running, bool(so.scheduled_spec_decode_tokens)))
    assert (2, True) not in drafted  # two running: no drafts
    assert (2, False) in drafted and (1, True) in drafted  # b finished: a drafts again
    assert_stats_match(sched, worker)
