"""halserve.beam_search on its own: the parameters, vLLM's score, and the search driven by a toy
model (a fixed next-token distribution per sequence) checked against an exhaustive search."""
from __future__ import annotations

import asyncio
import itertools
import math
import random

import pytest

from halserve.beam_search import (
    BeamSearch,
    BeamSearchParams,
    get_beam_search_score,
    run_beam_search,
    run_beam_search_async,
    step_sampling_params,
)
from halserve.outputs import Logprob

EOS = 2
PROMPT = [1, 0, 1, 1]


def toy_logprobs(tokens: list[int], vocab: int, seed: int = 0) -> list[float]:
    """A fixed, spread-out log-softmax over ``vocab`` tokens for each sequence."""
    rng = random.Random(f"{seed}:{tokens}")
    logits = [rng.gauss(0.0, 2.0) for _ in range(vocab)]
    norm = math.log(sum(math.exp(x) for x in logits))
    return [x - norm for x in logits]


def toy_top(tokens: list[int], k: int, vocab: int) -> dict[int, Logprob]:
    """What the engine returns for a step request: the k most likely next tokens."""
    logprobs = toy_logprobs(tokens, vocab)
    ranked = sorted(range(vocab), key=lambda t: -logprobs[t])[:k]
    return {t: Logprob(logprobs[t], rank + 1) for rank, t in enumerate(ranked)}


def toy_run_batch(params: BeamSearchParams, vocab: int, calls: list[list[list[int]]] | None = None):
    def run_batch(batch: list[list[int]]) -> list[dict[int, Logprob]]:
        if calls is not None:
            calls.append([list(tokens) for tokens in batch])
        return [toy_top(tokens, 2 * params.beam_width, vocab) for tokens in batch]

    return run_batch


def exhaustive(prompt: list[int], vocab: int, depth: int, ignore_eos: bool, length_penalty: float
               ) -> dict[tuple[int, ...], tuple[float, float]]:
    """Every hypothesis beam search can return, by its generated tokens (a finishing EOS
    included): (cum_logprob, vLLM's score). Without ignore_eos a sequence ends at its first EOS.
    The score never counts a final EOS in the length, with ignore_eos too (as vLLM's)."""
    out = {}
    for seq in itertools.product(range(vocab), repeat=depth):
        cum, generated = 0.0, []
        for token in seq:
            cum += toy_logprobs(prompt + generated, vocab)[token]
            generated.append(token)
            if token == EOS and not ignore_eos:
                break
        num_counted = len(generated) - (generated[-1] == EOS)
        out[tuple(generated)] = (cum, cum / (len(prompt) + num_counted) ** length_penalty)
    return out


@pytest.mark.parametrize("kwargs, field", [
    (dict(beam_width=0), "beam_width"),
    (dict(beam_width=11), "beam_width"),
    (dict(beam_width=True), "beam_width"),
    (dict(beam_width=2.0), "beam_width"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=None), "max_tokens"),
    (dict(temperature=0.7), "temperature"),
    (dict(length_penalty=float("nan")), "length_penalty"),
    (dict(length_penalty="1"), "length_penalty"),
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output"),
])
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})


def test_score_is_vllms_length_penalised_cum_logprob():
    # length = prompt + generated tokens, a final EOS not counted
    assert get_beam_search_score([5, 6, 7, 8], -8.0, {EOS}) == -2.0
    assert get_beam_search_score([5, 6, 7, EOS], -9.0, {EOS}) == -3.0
    # past float's range the limits (they used to raise: a 500 over HTTP); a lone EOS counts as length 1
    assert get_beam_search_score([5, 6, 7], -9.0, {EOS}, length_penalty=1000.0) == 0.0
    assert get_beam_search_score([5, 6, 7], -9.0, {EOS}, length_penalty=-1000.0) == float("-inf")
    assert get_beam_search_score([5, 6, 7], 0.0, {EOS}, length_penalty=-1000.0) == 0.0
    assert get_beam_search_score([EOS], -2.0, {EOS}, length_penalty=1.0) == -2.0
    assert get_beam_search_score([5, 6, 7, 8], -8.0, {EOS}, length_penalty=2.0) == -0.5
    assert get_beam_search_score([5, 6, 7, 8], -8.0, {EOS}, length_penalty=0.0) == -8.0


def test_step_requests_are_greedy_one_token_with_2x_beam_width_logprobs():
    step = step_sampling_params(BeamSearchParams(beam_width=3, max_tokens=5))
    assert (step.max_tokens, step.temperature, step.logprobs) == (1, 0.0, 6)
    # set explicitly, so a model's generation_config defaults cannot change the chosen token
    assert {"temperature", "top_p", "top_k", "repetition_penalty"} <= step.explicit_fields


@pytest.mark.parametrize("vocab, depth, beam_width", [(3, 3, 9), (4, 2, 4), (5, 3, 10)])
@pytest.mark.parametrize("ignore_eos", [True, False])
@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.5])
def test_matches_exhaustive_search_where_beam_search_is_exact(vocab, depth, beam_width, ignore_eos, length_penalty):
    params = BeamSearchParams(beam_width=beam_width, max_tokens=depth, ignore_eos=ignore_eos,
                              length_penalty=length_penalty)
    (out,) = run_beam_search([BeamSearch(PROMPT, params, {EOS})], toy_run_batch(params, vocab))
    truth = exhaustive(PROMPT, vocab, depth, ignore_eos, length_penalty)
    returned = []
    for seq in out.sequences:
        generated = tuple(seq.tokens[len(PROMPT):]) + ((EOS,) if seq.finish_reason == "stop" else ())
        cum, score = truth[generated]
        assert seq.cum_logprob == pytest.approx(cum, abs=1e-9)
        assert seq.finish_reason == ("stop" if EOS in generated and not ignore_eos else "length")
        returned.append(score)
    assert returned == sorted(returned, reverse=True)
    assert len(returned) == min(beam_width, len(truth))
    # exact where every prefix survives every step but the last
    exact = beam_width >= (vocab - (not ignore_eos)) ** (depth - 1)
    if not ignore_eos:
        best = sorted((score for _, score in truth.values()), reverse=True)
        assert returned == pytest.approx(best[:beam_width], abs=1e-9) if exact else returned[0] <= best[0] + 1e-12
    else:  # every beam has depth tokens: the last step keeps the best cum_logprobs, then ranks them by score
        best_cums = sorted((cum for cum, _ in truth.values()), reverse=True)[:beam_width]
        cums = sorted((seq.cum_logprob for seq in out.sequences), reverse=True)
        assert cums == pytest.approx(best_cums, abs=1e-9) if exact else cums[0] <= best_cums[0] + 1e-12


def test_eos_finishes_a_beam_and_is_kept_only_with_include_stop_str():
    params = BeamSearchParams(beam_width=9, max_tokens=3)
    (out,) = run_beam_search([BeamSearch(PROMPT, params, {EOS})], toy_run_batch(params, 3))
    finished = [s for s in out.sequences if s.finish_reason == "stop"]
    assert finished and all(s.stop_reason == EOS and EOS not in s.tokens[len(PROMPT):] for s in finished)
    assert all(len(s.tokens) == len(PROMPT) + 3 and EOS not in s.tokens[len(PROMPT):]
               for s in out.sequences if s.finish_reason == "length")

    kept = BeamSearchParams(beam_width=9, max_tokens=3, include_stop_str_in_output=True)
    (out_kept,) = run_beam_search([BeamSearch(PROMPT, kept, {EOS})], toy_run_batch(kept, 3))
    assert [s.tokens + ([EOS] if s.finish_reason == "stop" else []) for s in out.sequences] == \
        [s.tokens for s in out_kept.sequences]  # the same beams, in the same order
    assert [s.cum_logprob for s in out.sequences] == [s.cum_logprob for s in out_kept.sequences]

    ignoring = BeamSearchParams(beam_width=9, max_tokens=3, ignore_eos=True)
    (out_ign,) = run_beam_search([BeamSearch(PROMPT, ignoring, {EOS})], toy_run_batch(ignoring, 3))
    assert all(s.finish_reason == "length" and len(s.tokens) == len(PROMPT) + 3 for s in out_ign.sequences)
    assert any(EOS in s.tokens[len(PROMPT):] for s in out_ign.sequences)


def test_length_penalty_reorders_finished_and_live_beams():
    orders = {}
    for length_penalty in (0.0, 4.0):
        params = BeamSearchParams(beam_width=9, max_tokens=3, length_penalty=length_penalty)
        (out,) = run_beam_search([BeamSearch(PROMPT, params, {EOS})], toy_run_batch(params, 3))
        scores = [get_beam_search_score(s.tokens, s.cum_logprob, {EOS}, length_penalty) for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        orders[length_penalty] = [tuple(s.tokens) for s in out.sequences]
    assert orders[0.0] != orders[4.0]


def test_beam_width_one_is_greedy():
    params = BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True)
    (out,) = run_beam_search([BeamSearch(PROMPT, params, {EOS})], toy_run_batch(params, 5))
    tokens, cum = list(PROMPT), 0.0
    for _ in range(6):
        logprobs = toy_logprobs(tokens, 5)
        best = max(range(5), key=lambda t: logprobs[t])
        tokens.append(best)
        cum += logprobs[best]
    (seq,) = out.sequences
    assert seq.tokens == tokens and seq.cum_logprob == pytest.approx(cum)


def test_searches_run_in_lockstep_and_stop_at_max_model_len():
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    calls: list[list[list[int]]] = []
    short, long = BeamSearch([1] * 5, params, {EOS}, max_model_len=8), BeamSearch([1] * 2, params, {EOS}, 8)
    outs = run_beam_search([short, long], toy_run_batch(params, 6, calls), decode=lambda ids: f"{len(ids)} ids")
    # one batch per step, holding every live beam of both searches; the short prompt has room for 3 tokens
    assert [len(batch) for batch in calls] == [2, 6, 6, 3, 3, 3]
    assert {len(s.tokens) for s in outs[0].sequences} == {8} and {len(s.tokens) for s in outs[1].sequences} == {8}
    assert all(s.finish_reason == "length" and s.text == "8 ids" for out in outs for s in out.sequences)
    assert outs[0].prompt_token_ids == [1] * 5


def test_a_step_that_returns_nothing_drops_its_beam():
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    (out,) = run_beam_search([BeamSearch(PROMPT, params, {EOS})], lambda batch: [None] * len(batch))
    assert out.sequences == []


def test_async_steps_run_concurrently_and_cancel_together():
    params = BeamSearchParams(beam_width=4, max_tokens=50, ignore_eos=True)
    state = {"in_flight": 0, "most": 0, "cancelled": 0, "steps": 0}

    async def run_one(tokens):
        state["in_flight"] += 1
        state["most"] = max(state["most"], state["in_flight"])
        try:
            await asyncio.sleep(0.01)
            return toy_top(tokens, 8, 7)
        except asyncio.CancelledError:
            state["cancelled"] += 1
            raise
        finally:
            state["in_flight"] -= 1

    async def main():
        search = BeamSearch(PROMPT, params, {EOS})
        task = asyncio.ensure_future(run_beam_search_async([search], run_one))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return search

    search = asyncio.run(main())
    assert state["most"] == 4  # a step's four beams were in flight together
    assert state["cancelled"] == 4 and state["in_flight"] == 0  # the caller's cancel reached every one
    assert not search.done


def test_async_failure_cancels_the_steps_other_requests():
    params = BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True)
    cancelled = []

    async def run_one(tokens):
        if tokens[-1] == 1 and len(tokens) > len(PROMPT):
            raise ValueError("refused")
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            cancelled.append(tokens)
            raise
        return toy_top(tokens, 6, 4)

    async def first_step(tokens):  # step 1 answers at once, then the run_one above
        return toy_top(tokens, 6, 4) if len(tokens) == len(PROMPT) else await run_one(tokens)

    with pytest.raises(ValueError, match="refused"):
        asyncio.run(run_beam_search_async([BeamSearch(PROMPT, params, {EOS})], first_step))
    assert len(cancelled) == 2  # the step's other two beams
