"""Engine behaviour beyond greedy equivalence: prefix caching, logprobs, seeded and
parallel sampling, input validation, stop strings, chat."""
from __future__ import annotations

import math
import random

import pytest
import torch

from halserve import LLM, SamplingParams

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')


@pytest.fixture(scope="module")
def llama_path(checkpoint_factory):
    return checkpoint_factory("llama")


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(llama_path, platform="cpu", dtype="float32", block_size=16, max_num_batched_tokens=128,
               max_model_len=256)


def _vocab(llm):
    return llm.llm_engine.model_info.vocab_size


def test_prefix_caching_hits_and_computes_fewer_tokens(llama_path):
    llm = LLM(llama_path, platform="cpu", dtype="float32", block_size=16, max_model_len=256)
    rng = random.Random(7)
    vocab = _vocab(llm)
    prefix = [rng.randrange(3, vocab) for _ in range(96)]
    prompts = [{"prompt_token_ids": prefix + [rng.randrange(3, vocab) for _ in range(5)]} for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    stats1 = llm.llm_engine.get_stats()
    second = llm.generate(prompts, params, use_tqdm=False)
    stats2 = llm.llm_engine.get_stats()
    hits = stats2.prefix_cache_hits - stats1.prefix_cache_hits
    assert hits >= 4 * 96, f"second pass should hit the shared 96-token prefix of every prompt, hit {hits}"
    assert all(o.num_cached_tokens >= 96 for o in second)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]


def test_logprobs_match_transformers(llm, llama_path):
    from transformers import AutoModelForCausalLM

    rng = random.Random(3)
    prompt = [rng.randrange(3, _vocab(llm)) for _ in range(20)]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=6, logprobs=5,
                                                                    ignore_eos=True), use_tqdm=False)[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + out.token_ids])
    with torch.inference_mode():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    assert len(out.logprobs) == 6
    cumulative = 0.0
    for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        ref = logp[len(prompt) - 1 + step]
        assert abs(entry[tok].logprob - ref[tok].item()) < 1e-4
        assert entry[tok].rank == 1  # greedy picks the top token
        top = torch.topk(ref, 5)
        for t, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert t in entry, f"top-5 token {t} missing at step {step}"
            assert abs(entry[t].logprob - lp) < 1e-4
        cumulative += entry[tok].logprob
    assert math.isclose(out.cumulative_logprob, cumulative, rel_tol=1e-5, abs_tol=1e-5)


def test_prompt_logprobs_match_transformers_across_chunks_and_cached_prefixes(llm, llama_path):
    from transformers import AutoModelForCausalLM

    rng = random.Random(4)
    vocab = _vocab(llm)
    shared = [rng.randrange(3, vocab) for _ in range(64)]  # 4 full blocks, cached by the first request
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 150)]  # 150: 2+ chunks of 128
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    scored = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    llm.generate({"prompt_token_ids": prompts[0]}, plain, use_tqdm=False)  # the shared blocks enter the cache
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts] + [{"prompt_token_ids": prompts[0]}],
                        [scored, scored, plain], use_tqdm=False)
    assert outs[2].prompt_logprobs is None and outs[2].num_cached_tokens == 64  # not asked: the cache serves
    for prompt, out in zip(prompts, outs):
        assert out.num_cached_tokens == 0  # every position's logits are needed: no cache hit
        with torch.inference_mode():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
        pl = out.prompt_logprobs
        assert len(pl) == len(prompt) and pl[0] is None
        for pos in range(1, len(prompt)):
            entry, tok, row = pl[pos], prompt[pos], ref[pos - 1]
            assert abs(entry[tok].logprob - row[tok].item()) < 1e-4, pos
            assert entry[tok].rank == int((row > row[tok]).sum()) + 1
            top = torch.topk(row, 3)
            assert all(abs(entry[t].logprob - v) < 1e-4 for t, v in zip(top.indices.tolist(), top.values.tolist()))
        assert out.outputs[0].token_ids[0] == int(ref[-1].argmax())  # sampling is unchanged
    # n > 1: the prompt is scored once per request, not per sample
    out = llm.generate({"prompt_token_ids": prompts[0][:10]},
                       SamplingParams(n=2, temperature=1.0, max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == 10 and all(len(d) in (1, 2) for d in out.prompt_logprobs[1:])


def test_prompt_logprobs_survive_preemption(llama_path):
    """A tiny cache preempts requests mid-prefill and mid-decode; recomputed prompts must
    neither lose nor repeat prompt logprobs (they are sent once, with the first token)."""
    rng = random.Random(9)
    roomy = LLM(llama_path, platform="cpu", dtype="float32", block_size=16, max_num_batched_tokens=64,
                max_model_len=256)
    vocab = _vocab(roomy)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]} for n in (90, 40, 120, 70, 100, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=1, logprobs=0)
    want = roomy.generate(prompts, params, use_tqdm=False)
    tight = LLM(llama_path, platform="cpu", dtype="float32", block_size=16, max_num_batched_tokens=64,
                max_model_len=256, num_kv_blocks=16)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.get_stats().num_preemptions > 0, "the tiny cache should have forced preemption"
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) == len(w.prompt_token_ids)
        for pos, (a, b) in enumerate(zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:]), start=1):
            tok = w.prompt_token_ids[pos]
            assert abs(a[tok].logprob - b[tok].logprob) < 1e-4, pos


def test_structured_outputs_survive_preemption_and_batching(llama_path):
    """Grammar matchers live in the model runner: a request preempted after some tokens
    rebuilds its matcher from them; constrained and free requests share steps."""
    import re

    regex = "[a-z]{3,6}(-[0-9]{2,4}){2,5}"
    constrained = SamplingParams(temperature=1.0, seed=7, max_tokens=40, structured_outputs={"regex": regex})
    free = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i] * (60 + 10 * i)} for i in range(6)]
    params = [constrained, free] * 3
    kwargs = dict(platform="cpu", dtype="float32", block_size=16, max_num_batched_tokens=64, max_model_len=256)
    want = LLM(llama_path, **kwargs).generate(prompts, params, use_tqdm=False)
    tight = LLM(llama_path, **kwargs, num_kv_blocks=16)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.get_stats().num_preemptions > 0, "the tiny cache should have forced preemption"
    for i, (w, g) in enumerate(zip(want, got)):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, i
        if i % 2 == 0:
            assert g.outputs[0].finish_reason == "stop" and re.fullmatch(regex, g.outputs[0].text), g.outputs[0].text
        else:
            assert len(g.outputs[0].token_ids) == 40
    with pytest.raises(ValueError, match="invalid regex"):
        tight.generate(prompts[0], SamplingParams(structured_outputs={"regex": "[a-"}), use_tqdm=False)


def test_structured_outputs_start_after_a_marker_across_preemption(llama_path):
    """start_after (what --reasoning-parser sets to </think>): generation is free until the
    marker's tokens appear, the grammar applies from there; a request preempted on either side
    of the marker replays its tokens into the same state."""
    import re

    regex = "[a-z]{3,6}(-[0-9]{2,4}){1,3}"
    marker = [7, 9]
    kwargs = dict(platform="cpu", dtype="float32", block_size=16, max_num_batched_tokens=64, max_model_len=256)
    roomy = LLM(llama_path, **kwargs)
    # the marker nudged to come within a few tokens
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=48, logit_bias={7: 8.0, 9: 8.0},
                             structured_outputs={"regex": regex, "start_after": marker}) for s in range(6)]
    prompts = [{"prompt_token_ids": [5 + i] * (60 + 10 * i)} for i in range(6)]
    want = roomy.generate(prompts, params, use_tqdm=False)
    tight = LLM(llama_path, **kwargs, num_kv_blocks=16)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.get_stats().num_preemptions > 0, "the tiny cache should have forced preemption"
    tokenizer = roomy.get_tokenizer()
    free_tokens, marked = 0, 0
    for i, (w, g) in enumerate(zip(want, got)):
        ids = g.outputs[0].token_ids
        assert ids == w.outputs[0].token_ids, i
        end = next((j + 2 for j in range(len(ids) - 1) if ids[j : j + 2] == marker), None)
        if end is None:  # never marked: free all along, up to max_tokens
            assert g.outputs[0].finish_reason == "length", (i, ids)
            continue
        marked += 1
        free_tokens += end - 2
        constrained = tokenizer.decode(ids[end:], skip_special_tokens=True)
        assert re.fullmatch(regex, constrained), (i, constrained)
        assert g.outputs[0].finish_reason == "stop"
    assert marked >= 4, "the nudge should bring the marker in most requests"
    assert free_tokens > 0, "some tokens before the marker: generation there was free"
    with pytest.raises(ValueError, match="start_after must be a non-empty list of token ids"):
        SamplingParams(structured_outputs={"regex": regex, "start_after": []})
    # opened_by: the wait holds only for an output that opens with that token; the matcher
    # sees the tokens after the marker, or all of them when the output opens otherwise
    from halserve.structured_output import RequestGrammar, StructuredOutputsParams

    class Matcher:  # records what the grammar is fed
        def __init__(self):
            self.fed = []

        def is_terminated(self):
            return False

        def accept_token(self, token_id):
            self.fed.append(token_id)
            return True

    def fed(params, tokens):
        grammar = RequestGrammar(params, Matcher(), waits=params.start_after is not None,
                                 gated=params.opened_by is not None)
        for i, token_id in enumerate(tokens):
            assert grammar.follow(token_id, tokens[:i])
        return grammar.matcher.fed, grammar.active

    gated = StructuredOutputsParams(regex=regex, start_after=[9], opened_by=7)
    assert fed(gated, []) == ([], False) and fed(gated, [7, 3]) == ([], False)
    assert fed(gated, [7, 3, 9, 4]) == ([4], True) and fed(gated, [5, 9, 4]) == ([5, 9, 4], True)
    two = StructuredOutputsParams(regex=regex, start_after=[3, 9])
    assert fed(two, [9, 3, 3, 9, 9, 4]) == ([9, 4], True) and fed(two, [3, 3, 4, 9]) == ([], False)
    with pytest.raises(ValueError, match="opened_by must be a token id and needs start_after"):
        StructuredOutputsParams(regex=regex, opened_by=7)
    with pytest.raises(ValueError, match="json must be a JSON schema"):  # (false is given, not "none")
        StructuredOutputsParams(json=False)


def test_seeded_sampling_reproducible_across_runs_and_batches(llm):
    rng = random.Random(11)
    vocab = _vocab(llm)
    target = {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(12)]}
    others = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))]} for _ in range(6)]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(target, seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(target, seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(others[:3] + [target] + others[3:], [unseeded] * 3 + [seeded] + [unseeded] * 3,
                         use_tqdm=False)[3].outputs[0].token_ids
    assert alone == again == mixed


def test_parallel_sampling_n4(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]}, params, use_tqdm=False)[0]
    assert len(out.outputs) == 4
    assert sorted(o.index for o in out.outputs) == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "4 samples at temperature 1 should differ"


BAD_PARAMS = [
    dict(max_tokens=0),
    dict(min_tokens=5, max_tokens=2),
    dict(temperature=-0.5),
    dict(temperature=float("nan")),
    dict(top_p=0.0),
    dict(top_p=1.5),
    dict(top_k=-2),
    dict(min_p=-0.1),
    dict(min_p=1.5),
    dict(presence_penalty=2.5),
    dict(frequency_penalty=-3.0),
    dict(repetition_penalty=0.0),
    dict(stop=[""]),
    dict(n=2, temperature=0.0),
    dict(logprobs=21),
    dict(prompt_logprobs=-1),
    dict(logit_bias={-1: 1.0}),
    dict(allowed_token_ids=[]),
    dict(stop=5),  # (these three were a TypeError or taken as a list of the dict's keys)
    dict(stop={"a": 1}),
    dict(stop_token_ids=5),
    dict(repetition_penalty=1e-300),  # (float32 underflow: logits divided by 0)
]


@pytest.mark.parametrize("bad", BAD_PARAMS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_bad_sampling_params_raise(bad):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**bad)
    assert str(exc.value)


def test_bad_prompts_raise_and_engine_keeps_serving(llm):
    vocab = _vocab(llm)
    good = {"prompt_token_ids": [4, 5, 6]}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = llm.generate(good, params, use_tqdm=False)[0].outputs[0].token_ids
    bad_prompts = [
        "",
        {"prompt_token_ids": []},
        {"prompt_token_ids": [vocab]},
        {"prompt_token_ids": [-1]},
        {"prompt_token_ids": [5] * 300},  # max_model_len is 256
    ]
    for bad in bad_prompts:
        with pytest.raises(ValueError) as exc:
            llm.generate([good, bad, good], params, use_tqdm=False)
        assert str(exc.value)
        # The engine still serves, and no request of the failed batch lingers.
        assert not llm.llm_engine.has_unfinished_requests()
        assert llm.generate(good, params, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert llm.llm_engine.get_stats().kv_cache_usage == 0.0
    # the wrong kind of argument altogether: a ValueError saying what is expected
    for args, message in (((None,), "prompts must be"), ((b"hi",), "got bytes"), ((good, {"max_tokens": 2}),
                          "sampling_params must be"), ((good, "greedy"), "sampling_params must be")):
        with pytest.raises(ValueError, match=message):
            llm.generate(*args, use_tqdm=False)
    for messages in ("hi", {"role": "user", "content": "hi"}, None, [[{"role": "user", "content": "hi"}], ["x"]]):
        with pytest.raises(ValueError, match="messages must be a conversation"):
            llm.chat(messages, use_tqdm=False)
    with pytest.raises(ValueError, match="the chat template could not render"):
        llm.chat([{"role": "user", "content": "hi"}], chat_template="{% for %}", use_tqdm=False)
    assert llm.generate(good, params, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_logit_bias_beyond_100_is_clamped_not_overflowed(llm):
    """A finite bias past float32's range used to make the logits inf/NaN (a stream of token 0)."""
    prompt = {"prompt_token_ids": [4, 5, 6, 7]}
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={9: 1e39})
    assert params.logit_bias == {9: 100.0}
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == [9, 9, 9]


def test_logit_bias_and_allowed_token_ids(llm):
    vocab = _vocab(llm)
    prompt = {"prompt_token_ids": [4, 5, 6, 7]}
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    base = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    forced = vocab - 1 if base[0] != vocab - 1 else vocab - 2
    biased = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={forced: 100.0})
    banned = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={base[0]: -100.0})
    allowed = [9, 10, 11]
    restricted = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)
    # one batch: the lists of one request do not leak into the others
    outs = llm.generate([prompt] * 4, [biased, banned, restricted, greedy], use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got[0] == [forced] * 6
    assert got[1][0] != base[0]
    assert set(got[2]) <= set(allowed) and len(got[2]) == 12
    assert got[3] == base
    # an id past the vocabulary is refused when the request is added, and the engine serves on
    for bad in (dict(logit_bias={vocab: 1.0}), dict(allowed_token_ids=[1, vocab + 5])):
        with pytest.raises(ValueError, match=f"out of range: the model's vocabulary has {vocab} tokens"):
            llm.generate(prompt, SamplingParams(max_tokens=2, **bad), use_tqdm=False)
    # only stop tokens allowed while min_tokens forbids them: nothing could be sampled
    eos = next(iter(llm.llm_engine.model_info.eos_token_ids))
    for only_stops in (dict(allowed_token_ids=[eos]), dict(allowed_token_ids=[8, eos], stop_token_ids=[8])):
        with pytest.raises(ValueError, match="holds only stop tokens"):
            llm.generate(prompt, SamplingParams(max_tokens=4, min_tokens=2, **only_stops), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == base


def test_request_that_can_never_fit_is_an_error(llama_path):
    llm = LLM(llama_path, platform="cpu", dtype="float32", block_size=16, num_kv_blocks=4, max_model_len=256)
    with pytest.raises(ValueError, match="KV cache|kv cache|cache"):
        llm.generate({"prompt_token_ids": [5] * 100}, SamplingParams(max_tokens=10, temperature=0.0),
                     use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=5, temperature=0.0,
                                                                      ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5


def test_stop_string_and_text(llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = llm.generate("the quick brown fox", params, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    # A trailing incomplete UTF-8 character is held back, never emitted as U+FFFD.
    assert full.text == tok.decode(full.token_ids, skip_special_tokens=True).rstrip("\ufffd")
    assert "\ufffd" not in full.text[-1:]
    if len(full.text.strip()) < 4:
        pytest.skip("the random model produced too little text to cut a stop string from")
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    cut = llm.generate("the quick brown fox", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                            stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]


def test_chat_applies_template(llm):
    messages = [{"role": "user", "content": "hello there"}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    assert out.prompt_token_ids == list(expected)
    assert len(out.outputs[0].token_ids) == 4


def test_warm_up_runs_a_full_step_without_touching_the_cache(llm):
    """The start-up warm-up forwards max_num_batched_tokens dummy tokens (so the GEMM
    library and the allocator are ready for the largest step) and writes no KV."""
    runner = llm.llm_engine.core.executor.worker.model_runner
    seen = []
    handle = runner.model.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    try:
        before = [cache.clone() for cache in runner.kv_caches]
        runner.warm_up()
    finally:
        handle.remove()
    assert seen == [llm.llm_engine.config.max_num_batched_tokens]
    assert all(torch.equal(b, a) for b, a in zip(before, runner.kv_caches))
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
