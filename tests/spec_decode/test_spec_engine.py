"""Speculative decoding (n-gram drafts) through the offline ``LLM`` on a tiny random-weight llama:
outputs must be those of the same engine without speculation, token for token — greedy and
seeded sampling alike (each position draws from the same seeded noise stream), with logprobs,
penalties, stops, bad words, structured outputs, n > 1, preemption, prefix caching and the
max_model_len limit.

Each test that relies on drafts being checked asserts that some were accepted (random tiny
models repeat themselves; the repetitive prompts below make sure of it), so none passes
vacuously.
"""
from __future__ import annotations

import random
import re

import pytest

from halserve import LLM, SamplingParams

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

REPETITIVE = [[9, 10] * 8, [5, 6, 7, 8] * 5, [40, 41, 42] * 4 + [40]]


def random_prompts(lengths, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def as_inputs(prompts):
    return [{"prompt_token_ids": list(p)} for p in prompts]


def accepted(llm: LLM) -> int:
    return llm.llm_engine.get_stats().spec_num_accepted_tokens


def generate(llm, prompts, params):
    return llm.generate(as_inputs(prompts), params, use_tqdm=False)


def run_both(base, spec, prompts, params):
    """(base outputs, spec outputs, drafts accepted by spec during this call)."""
    want = generate(base, prompts, params)
    before = accepted(spec)
    got = generate(spec, prompts, params)
    return want, got, accepted(spec) - before


def summary(outputs):
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


def step_trace(llm, prompt, params):
    """Run one request step by step; the list of token-id chunks each step appended."""
    engine = llm.llm_engine
    rid = f"trace-{random.random()}"
    engine.add_request(rid, {"prompt_token_ids": list(prompt)}, params)
    chunks, seen = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids = out.outputs[0].token_ids
            if len(ids) > seen:
                chunks.append(ids[seen:])
                seen = len(ids)
    return chunks


# -- greedy ------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_identical_to_no_speculation(spec_ckpt, engine_factory, block_size, k):
    base = engine_factory(spec_ckpt, block_size=block_size)
    spec = engine_factory(spec_ckpt, k=k, block_size=block_size)
    bs = block_size
    prompts = random_prompts([1, 3, bs - 1, bs, 2 * bs + 1, 37], 512, seed=block_size) + REPETITIVE
    # max_tokens so that prompt + output ends exactly on a block boundary (or one past it) for most
    params = []
    for i, p in enumerate(prompts):
        end = (len(p) // bs + 2 + i % 3) * bs + (i % 2)
        params.append(SamplingParams(temperature=0.0, max_tokens=end - len(p), ignore_eos=True))
    want, got, num_accepted = run_both(base, spec, prompts, params)
    assert summary(got) == summary(want)
    assert [len(o.outputs[0].token_ids) for o in got] == [p.max_tokens for p in params]
    assert num_accepted > 0, "the repetitive prompts should have had drafts accepted"


@pytest.mark.parametrize("variant", ["torch_attention", "sliding_window", "sliding_window_torch_attention"])
def test_greedy_identical_other_attention_paths(spec_ckpt, sliding_window_ckpt, engine_factory, variant):
    """The torch attention backend (the default on CPU is cpu_native) and a sliding-window model
    (window 16, shorter than most contexts here) check drafts like the rest."""
    path = sliding_window_ckpt if variant.startswith("sliding_window") else spec_ckpt
    kwargs = dict(block_size=16)
    if variant.endswith("torch_attention"):
        kwargs["attention_backend"] = "torch"
    base = engine_factory(path, **kwargs)
    spec = engine_factory(path, k=4, **kwargs)
    prompts = random_prompts([5, 30, 60], 512, seed=1) + REPETITIVE + [[5, 6, 7, 8] * 10]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want, got, num_accepted = run_both(base, spec, prompts, params)
    assert summary(got) == summary(want)
    assert num_accepted > 0


def test_greedy_multi_token_steps_really_happen(spec_ckpt, engine_factory):
    """The spec engine emits several tokens in one step (accepted drafts + bonus), and takes
    fewer steps than tokens; the non-spec engine one token per step."""
    spec = engine_factory(spec_ckpt, k=3, block_size=4)
    base = engine_factory(spec_ckpt, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    chunks = step_trace(spec, REPETITIVE[0], params)
    assert max(len(c) for c in chunks) >= 2 and max(len(c) for c in chunks) <= 4  # at most k + 1
    assert len(chunks) < 24
    assert sum(chunks, []) == generate(base, [REPETITIVE[0]], params)[0].outputs[0].token_ids
    assert all(len(c) == 1 for c in step_trace(base, REPETITIVE[0], params))
    stats = spec.llm_engine.get_stats()
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert stats.spec_num_drafts <= stats.spec_num_draft_tokens


# -- seeded sampling -------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 4])
def test_seeded_sampling_identical_to_no_speculation(small_vocab_ckpt, engine_factory, k):
    base = engine_factory(small_vocab_ckpt, block_size=4)
    spec = engine_factory(small_vocab_ckpt, k=k, block_size=4)
    prompts = random_prompts([2, 5, 9, 17], 24, seed=3) + [[9, 10] * 6, [5, 6, 7] * 4]
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=10, seed=1000 + i, max_tokens=30, ignore_eos=True)
              for i in range(len(prompts))]
    params[1] = SamplingParams(temperature=1.0, min_p=0.05, seed=7, max_tokens=30, ignore_eos=True)
    params[2] = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)  # greedy in the same batch
    want, got, num_accepted = run_both(base, spec, prompts, params)
    assert summary(got) == summary(want)
    assert num_accepted > 0
    # the seed matters (the comparison above is not trivially true)
    other = generate(base, prompts[:1], SamplingParams(temperature=0.8, top_p=0.9, top_k=10, seed=999,
                                                       max_tokens=30, ignore_eos=True))
    assert other[0].outputs[0].token_ids != want[0].outputs[0].token_ids


# -- logprobs ------------------------------------------------------------------------------------
def test_logprobs_one_entry_per_token_and_equal_to_no_speculation(spec_ckpt, engine_factory):
    base = engine_factory(spec_ckpt, block_size=4)
    spec = engine_factory(spec_ckpt, k=3, block_size=4)
    prompts = REPETITIVE + random_prompts([6, 20], 512, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    want, got, num_accepted = run_both(base, spec, prompts, params)
    assert num_accepted > 0
    for w, g in zip(want, got):
        wo, go = w.outputs[0], g.outputs[0]
        assert go.token_ids == wo.token_ids
        assert len(go.logprobs) == len(go.token_ids) == 24
        for pos, (tok, a, b) in enumerate(zip(go.token_ids, wo.logprobs, go.logprobs)):
            assert tok in b and b[tok].rank == 1, pos  # greedy: the sampled token is the top one
            assert 2 <= len(b) <= 3
            assert a.keys() == b.keys(), pos
            for t in a:
                assert b[t].logprob == pytest.approx(a[t].logprob, abs=1e-4), (pos, t)
                assert b[t].rank == a[t].rank
        assert go.cumulative_logprob == pytest.approx(wo.cumulative_logprob, abs=1e-3)


def test_prompt_logprobs_next_to_drafts(spec_ckpt, engine_factory):
    """A request scoring its prompt (chunked over steps) in the same batches as drafting ones."""
    base = engine_factory(spec_ckpt, block_size=4)
    spec = engine_factory(spec_ckpt, k=3, block_size=4)
    prompts = [REPETITIVE[0], random_prompts([90], 512, seed=2)[0], REPETITIVE[1]]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=1, logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=0)]
    want, got, num_accepted = run_both(base, spec, prompts, params)
    assert num_accepted > 0
    assert summary(got) == summary(want)
    for w, g in zip(want[1:], got[1:]):
        assert len(g.prompt_logprobs) == len(g.prompt_token_ids) and g.prompt_logprobs[0] is None
        for pos, (a, b) in enumerate(zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:]), start=1):
            tok = g.prompt_token_ids[pos]
            assert b[tok].logprob == pytest.approx(a[tok].logprob, abs=1e-4), pos


def test_sampled_logprobs_identical(small_vocab_ckpt, engine_factory):
    base = engine_factory(small_vocab_ckpt, block_size=4)
    spec = engine_factory(small_vocab_ckpt, k=4, block_size=4)
    prompts = [[9, 10] * 6, [5, 6, 7] * 4, [12, 13, 14]]
    params = [SamplingParams(temperature=0.7, seed=40 + i, max_tokens=20, ignore_eos=True, logprobs=1)
              for i in range(len(prompts))]
    want, got, num_accepted = run_both(base, spec, prompts, params)
    assert num_accepted > 0
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.outputs[0].logprobs) == 20
        for tok, a, b in zip(g.outputs[0].token_ids, w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert b[tok].logprob == pytest.approx(a[tok].logprob, abs=1e-4) and b[tok].rank == a[tok].rank


# -- penalties -------------------------------------------------------------------------------------
PENALTIES = [
    dict(repetition_penalty=1.3),
    dict(frequency_penalty=0.5),
    dict(presence_penalty=0.5),
    dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1),
    dict(frequency_penalty=-0.8),  # rewards repeats: many drafts accepted
]


@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_penalties_identical(small_vocab_ckpt, engine_factory, penalty):
    base = engine_factory(small_vocab_ckpt, block_size=4)
    spec = engine_factory(small_vocab_ckpt, k=3, block_size=4)
    prompts = [[9, 10] * 6, [5, 6, 7] * 4, [3, 4, 5, 6, 7, 8, 9, 10, 11], [20]]
    params = [SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True, **penalty),
              SamplingParams(temperature=0.9, seed=5, max_tokens=28, ignore_eos=True, **penalty)] * 2
    want, got, num_accepted = run_both(base, spec, prompts, params)
    assert summary(got) == summary(want)
    assert num_accepted > 0
    # the penalty changes the greedy output (else the test says nothing about penalties)
    greedy = [0, 2]  # the prompts run greedy with the penalty
    plain = generate(base, [prompts[i] for i in greedy], SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in plain] != [want[i].outputs[0].token_ids for i in greedy]


# -- stops, min_tokens, bad_words ---------------------------------------------------------------------
def test_stop_token_ids_and_min_tokens_identical(spec_ckpt, engine_factory):
    base = engine_factory(spec_ckpt, block_size=4)
    spec = engine_factory(spec_ckpt, k=4, block_size=4)
    prompt = REPETITIVE[1]
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = generate(base, [prompt], free)[0].outputs[0].token_ids
    # spec's steps emit several tokens at once (accepted drafts, then one more)
    chunks = step_trace(spec, prompt, free)
    assert sum(chunks, []) == ref and max(len(c) for c in chunks) >= 3
    # each distinct token as a stop token; and, held off by min_tokens (which also keeps it from
    # being sampled before), wherever it comes next
    cases = []
    for tok in dict.fromkeys(ref):
        first = ref.index(tok)
        cases.append(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[tok]))
        if first + 2 < 40:
            cases.append(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[tok],
                                        min_tokens=first + 2))
    before = accepted(spec)
    want = generate(base, [prompt] * len(cases), cases)
    got = generate(spec, [prompt] * len(cases), cases)
    assert accepted(spec) > before
    assert summary(got) == summary(want)
    held_off_stops = 0
    for params, w in zip(cases, want):
        tok, out = params.stop_token_ids[0], w.outputs[0]
        if not params.min_tokens:
            assert out.token_ids == ref[: ref.index(tok) + 1]
            assert out.finish_reason == "stop" and out.stop_reason == tok
        elif out.finish_reason == "stop":
            assert out.token_ids[-1] == tok and tok not in out.token_ids[: params.min_tokens]
            assert len(out.token_ids) > params.min_tokens
            held_off_stops += 1
    assert held_off_stops >= 2


def test_eos_identical(small_vocab_ckpt, engine_factory):
    """Without ignore_eos, requests end at eos (id 2, made likelier by a logit bias) alike;
    min_tokens holds it off alike."""
    base = engine_factory(small_vocab_ckpt, block_size=4)
    spec = engine_factory(small_vocab_ckpt, k=3, block_size=4)
    prompts = random_prompts([3, 6, 9, 12, 4, 7], 24, seed=21) + [[9, 10] * 6, [5, 6, 7] * 4]
    params = [SamplingParams(temperature=0.0, max_tokens=40, min_tokens=(s % 3) * 4, logit_bias={2: 1.0 + s % 2})
              for s in range(len(prompts))]
    params[1] = SamplingParams(temperature=0.9, seed=4, max_tokens=40, logit_bias={2: 1.0})
    want, got, num_accepted = run_both(base, spec, prompts, params)
    assert summary(got) == summary(want)
    assert num_accepted > 0
    stopped = [o for o in want if o.outputs[0].finish_reason == "stop"]
    assert len(stopped) >= 3, "some requests should have ended at eos"
    for o, p in zip(want, params):
        out = o.outputs[0]
        assert len(out.token_ids) > p.min_tokens
        assert out.finish_reason == "length" or out.token_ids[-1] == 2


def test_stop_strings_identical(spec_ckpt, engine_factory):
    """A stop string completed by a token in the middle of a multi-token step: the text, the
    finish and stop reasons, and the token ids (up to the token that completed it) are those of
    the engine without speculation."""
    base = engine_factory(spec_ckpt, block_size=4)
    spec = engine_factory(spec_ckpt, k=3, block_size=4)
    prompt = REPETITIVE[0]  # " b b b ..." -> the model goes on with " b" tokens, drafted and accepted
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[" b b b"], logprobs=0)
    (want,), (got,), num_accepted = run_both(base, spec, [prompt], params)
    w, g = want.outputs[0], got.outputs[0]
    assert num_accepted > 0
    assert w.finish_reason == "stop" and w.stop_reason == " b b b"
    assert (g.text, g.finish_reason, g.stop_reason) == (w.text, w.finish_reason, w.stop_reason)
    assert g.token_ids == w.token_ids, "tokens after the one that completed the stop string were returned"
    assert len(g.logprobs) == len(w.logprobs)


def test_bad_words_identical(spec_ckpt, engine_factory):
    base = engine_factory(spec_ckpt, block_size=4)
    spec = engine_factory(spec_ckpt, k=3, block_size=4)
    tokenizer = base.get_tokenizer()
    prompt = REPETITIVE[0]
    ref = generate(base, [prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    # a two-token bad word " b b": " b" is banned only right after " b" (drafts count as outputs)
    cases = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, bad_words=[w])
             for w in (" b b", "b", " b b b")]
    before = accepted(spec)
    want = generate(base, [prompt] * 3, cases)
    got = generate(spec, [prompt] * 3, cases)
    assert accepted(spec) > before
    assert summary(got) == summary(want)
    b = tokenizer.encode(" b", add_special_tokens=False)
    assert len(b) == 1 and b[0] in ref.outputs[0].token_ids
    two = want[0].outputs[0].token_ids
    assert two != ref.outputs[0].token_ids
    assert not any(two[i] == two[i + 1] == b[0] for i in range(len(two) - 1))


# -- structured outputs next to speculation -----------------------------------------------------------
def test_structured_output_request_in_a_spec_batch(spec_ckpt, engine_factory):
    base = engine_factory(spec_ckpt, block_size=4)
    spec = engine_factory(spec_ckpt, k=3, block_size=4)
    regex = "[a-z]{2,5}(-[0-9]{2,3}){2,4}"
    prompts = [REPETITIVE[0], REPETITIVE[0], REPETITIVE[1], [9, 10] * 3]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"regex": regex}),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=10, structured_outputs={"choice": ["yes", "no", "maybe"]}),
    ]
    want, got, num_accepted = run_both(base, spec, prompts, params)
    assert num_accepted > 0
    assert summary(got) == summary(want)
    assert re.fullmatch(regex, got[0].outputs[0].text), got[0].outputs[0].text
    assert got[0].outputs[0].finish_reason == "stop"
    assert got[3].outputs[0].text in ("yes", "no", "maybe")


@pytest.mark.parametrize("constraint", [
    {"regex": "(the cat ){3,6}"},  # a repeating language: prompt lookup predicts it
    {"json": {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "boolean"},
                                                      "minItems": 6, "maxItems": 6}},
              "required": ["xs"]}},
], ids=["regex", "json"])
def test_drafts_checked_under_a_grammar(spec_ckpt, engine_factory, constraint):
    """A constrained request gets drafts its grammar allows, each position with its own mask;
    the output is the one without speculation and stays in the grammar."""
    import json

    base = engine_factory(spec_ckpt, block_size=4)
    spec = engine_factory(spec_ckpt, k=4, block_size=4)
    prompts = [REPETITIVE[0], random_prompts([5], 512, seed=4)[0]]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=constraint),
              SamplingParams(temperature=0.7, seed=2, max_tokens=60, structured_outputs=constraint)]
    want, got, num_accepted = run_both(base, spec, prompts, params)
    assert summary(got) == summary(want)
    assert num_accepted > 0  # (only these two constrained requests ran)
    for out in got:
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        if "regex" in constraint:
            assert re.fullmatch(constraint["regex"], text), text
        else:
            assert len(json.loads(text)["xs"]) == 6, text


# -- n > 1, preemption --------------------------------------------------------------------------------
def test_parallel_sampling_and_preemption_identical(spec_ckpt, small_vocab_ckpt, engine_factory):
    prompts = random_prompts([30, 12, 45, 20, 8, 36], 512, seed=5) + REPETITIVE
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) for _ in prompts]
    params[0] = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=24, ignore_eos=True)
    params[-1] = SamplingParams(n=2, temperature=0.8, seed=12, max_tokens=24, ignore_eos=True, logprobs=1)
    roomy = engine_factory(spec_ckpt, block_size=4)
    want = generate(roomy, prompts, params)
    tight = engine_factory(spec_ckpt, k=4, block_size=4, num_kv_blocks=28)  # 27 usable blocks = 108 tokens
    stats0 = tight.llm_engine.get_stats()
    got = generate(tight, prompts, params)
    stats1 = tight.llm_engine.get_stats()
    assert stats1.num_preemptions > stats0.num_preemptions, "the tiny cache should have forced preemption"
    assert stats1.spec_num_accepted_tokens > stats0.spec_num_accepted_tokens
    assert summary(got) == summary(want)
    assert len(got[0].outputs) == 2 and got[0].outputs[0].token_ids != got[0].outputs[1].token_ids
    for a, b in zip(want[-1].outputs, got[-1].outputs):
        assert len(b.logprobs) == len(b.token_ids)
        assert [d[t].logprob for t, d in zip(b.token_ids, b.logprobs)] == pytest.approx(
            [d[t].logprob for t, d in zip(a.token_ids, a.logprobs)], abs=1e-4)


# -- prefix caching -----------------------------------------------------------------------------------
def test_prefix_caching_with_speculation(spec_ckpt, engine_factory):
    base = engine_factory(spec_ckpt, block_size=4, enable_prefix_caching=False)
    spec = engine_factory(spec_ckpt, k=3, block_size=4)
    prompt = REPETITIVE[1] + random_prompts([9], 512, seed=9)[0]  # 29 tokens
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    first = generate(spec, [prompt], params)[0]
    before = spec.llm_engine.get_stats()
    second = generate(spec, [prompt, prompt + [77, 78]], params)
    after = spec.llm_engine.get_stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 2 * 28
    assert second[0].num_cached_tokens == 28 and second[1].num_cached_tokens >= 28
    assert second[0].outputs[0].token_ids == first.outputs[0].token_ids
    want = generate(base, [prompt, prompt + [77, 78]], params)
    assert summary(second) == summary(want)
    # a prompt continuing the first request's real output hits the blocks it computed
    cont = prompt + first.outputs[0].token_ids
    got = generate(spec, [cont], params)[0]
    assert got.num_cached_tokens >= ((len(prompt) + 20) // 4) * 4
    assert got.outputs[0].token_ids == generate(base, [cont], params)[0].outputs[0].token_ids
    assert after.spec_num_accepted_tokens > before.spec_num_accepted_tokens


# -- max_model_len ------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [2, 5])
def test_max_model_len_respected(spec_ckpt, engine_factory, k):
    base = engine_factory(spec_ckpt, block_size=4, max_model_len=48)
    spec = engine_factory(spec_ckpt, k=k, block_size=4, max_model_len=48)
    prompts = [REPETITIVE[0], REPETITIVE[1], REPETITIVE[0] * 2 + [9, 10, 9, 10, 9, 10, 9, 10, 9, 10, 9, 10, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    want, got, num_accepted = run_both(base, spec, prompts, params)
    assert summary(got) == summary(want)
    for p, o in zip(prompts, got):
        assert len(p) + len(o.outputs[0].token_ids) == 48 and o.outputs[0].finish_reason == "length"
    assert num_accepted > 0


# -- configuration -----------------------------------------------------------------------------------
def test_spec_config_as_json_string_with_the_uni_executor(spec_ckpt):
    llm = LLM(spec_ckpt, platform="cpu", dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=64,
              max_num_seqs=4, distributed_executor_backend="uni",
              speculative_config='{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}')
    spec = llm.llm_engine.config.speculative_config
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max, spec.min_ngram) == (2, 2, 2)
    out = llm.generate(as_inputs([REPETITIVE[0]]), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    stats = llm.llm_engine.get_stats()
    assert len(out.token_ids) == 16 and stats.spec_num_drafts > 0
    assert stats.spec_num_draft_tokens <= 2 * stats.spec_num_drafts


@pytest.mark.parametrize("value, match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "not supported"),
    ('{"num_speculative_tokens": 2', "not valid JSON"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
])
def test_bad_spec_config_refused_before_loading(spec_ckpt, value, match):
    with pytest.raises(ValueError, match=match):
        LLM(spec_ckpt, platform="cpu", dtype="float32", speculative_config=value)


def test_runner_without_spec_support_refuses(spec_ckpt):
    from halserve.config import EngineConfig
    from halserve.worker.model_runner import ModelRunner

    class NoSpecRunner(ModelRunner):
        supports_speculative_decoding = False

    class FakePlatform:
        name = "fake"

        def device(self):
            import torch

            return torch.device("cpu")

    config = EngineConfig(model=spec_ckpt, speculative_config={"num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="does not support speculative decoding"):
        NoSpecRunner(config, FakePlatform(), model_info=None)
    from halserve.worker.xla_model_runner import XlaModelRunner

    assert XlaModelRunner.supports_speculative_decoding is False
    assert ModelRunner.supports_speculative_decoding is True
