"""LLM.beam_search and AsyncLLM.beam_search on tiny random checkpoints, checked against the
model's own logprobs as transformers computes them (exhaustively, where the vocabulary is cut
small enough for beam search to be exact) and against greedy decoding."""
from __future__ import annotations

import asyncio
import itertools
import time

import pytest
import torch

from halserve import LLM, BeamSearchParams, SamplingParams
from halserve.beam_search import get_beam_search_score

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

EOS = 2
PROMPT_IDS = [1, 0, 1, 1, 0]  # (ids the 3-token model knows too)
PROMPTS = ["the quick brown fox", "hello world model"]


@pytest.fixture(scope="module")
def llama_path(checkpoint_factory):
    return checkpoint_factory("llama")


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(llama_path, platform="cpu", dtype="float32", block_size=16, max_model_len=256)


@pytest.fixture(scope="module")
def small_vocab(llama_path, tmp_path_factory):
    """vocab size -> (checkpoint, LLM) of the llama checkpoint cut to its first tokens."""
    from model_factory import with_vocab_size

    cache = {}

    def get(vocab: int):
        if vocab not in cache:
            path = with_vocab_size(llama_path, tmp_path_factory.mktemp(f"vocab{vocab}"), vocab)
            cache[vocab] = path, LLM(path, platform="cpu", dtype="float32", block_size=16, max_model_len=64)
        return cache[vocab]

    return get


def hf_token_logprobs(path: str, prompt: list[int], vocab: int, depth: int) -> dict[tuple[int, ...], list[float]]:
    """Every sequence of ``depth`` tokens -> each token's logprob after the prompt and the tokens
    before it: transformers' log-softmax of the checkpoint's logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seqs = list(itertools.product(range(vocab), repeat=depth))
    x = torch.tensor([prompt + list(seq) for seq in seqs])  # [N, P + depth]
    with torch.inference_mode():
        logprobs = model(x).logits.float().log_softmax(-1)  # [N, P + depth, V]
    p = len(prompt)
    chosen = logprobs[:, p - 1 : p - 1 + depth].gather(-1, x[:, p:, None]).squeeze(-1)  # [N, depth]
    return {seq: row for seq, row in zip(seqs, chosen.tolist())}


def hypotheses(token_logprobs, prompt_len: int, ignore_eos: bool, length_penalty: float):
    """What beam search can return, by generated tokens (a finishing EOS included): (cum_logprob,
    vLLM's score: cum / (prompt + generated, a final EOS not counted) ** length_penalty)."""
    out = {}
    for seq, logprobs in token_logprobs.items():
        end = len(seq) if ignore_eos or EOS not in seq else seq.index(EOS) + 1
        generated, cum = seq[:end], sum(logprobs[:end])
        out[generated] = (cum, cum / (prompt_len + end - (generated[-1] == EOS)) ** length_penalty)
    return out


# (vocab, depth, beam_width): beam search is exact where beam_width >= vocab ** (depth - 1)
@pytest.mark.parametrize("vocab, depth, beam_width", [(3, 3, 9), (8, 2, 8)])
def test_matches_exhaustive_search_over_the_models_logprobs(small_vocab, vocab, depth, beam_width):
    path, small = small_vocab(vocab)
    truth_logprobs = hf_token_logprobs(path, PROMPT_IDS, vocab, depth)
    finish_reasons = set()
    for ignore_eos, include_stop, length_penalty in [(True, False, 1.0), (False, False, 0.0), (False, False, 1.0),
                                                     (False, True, 1.0), (False, False, 3.0)]:
        params = BeamSearchParams(beam_width=beam_width, max_tokens=depth, ignore_eos=ignore_eos,
                                  length_penalty=length_penalty, include_stop_str_in_output=include_stop)
        (out,) = small.beam_search({"prompt_token_ids": PROMPT_IDS}, params)
        truth = hypotheses(truth_logprobs, len(PROMPT_IDS), ignore_eos, length_penalty)
        scores = []
        for seq in out.sequences:
            assert seq.tokens[: len(PROMPT_IDS)] == PROMPT_IDS
            generated = tuple(seq.tokens[len(PROMPT_IDS):])
            if seq.finish_reason == "stop":  # finished by EOS: kept in the tokens only when asked
                assert seq.stop_reason == EOS and (generated[-1:] == (EOS,)) == include_stop
                generated = generated if include_stop else generated + (EOS,)
            else:
                assert seq.finish_reason == "length" and len(generated) == depth
            cum, score = truth[generated]
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)  # the sum of transformers' log-softmax
            assert get_beam_search_score(seq.tokens, seq.cum_logprob, {EOS}, length_penalty) == \
                pytest.approx(score, abs=1e-4)
            scores.append(score)
        assert scores == sorted(scores, reverse=True)
        if ignore_eos:  # all of one length: the best cum_logprobs of all vocab ** depth sequences
            cums = sorted((cum for cum, _ in truth.values()), reverse=True)[:beam_width]
            assert sorted((s.cum_logprob for s in out.sequences), reverse=True) == pytest.approx(cums, abs=1e-4)
        else:  # nothing found by brute force, of any length, beats what came back
            best = sorted((score for _, score in truth.values()), reverse=True)[:beam_width]
            assert scores == pytest.approx(best, abs=1e-4)
        finish_reasons.update(s.finish_reason for s in out.sequences)
    assert finish_reasons == {"stop", "length"}  # EOS finished some of the beams returned


def test_beam_width_one_is_greedy_decoding(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0),
                          use_tqdm=False)
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True))
    for want, got in zip(greedy, beams):
        (seq,) = got.sequences
        assert got.prompt_token_ids == want.prompt_token_ids
        assert seq.tokens == want.prompt_token_ids + want.outputs[0].token_ids
        assert seq.cum_logprob == pytest.approx(want.outputs[0].cumulative_logprob, abs=1e-4)
        assert seq.finish_reason == "length"


def test_prompts_in_one_call_equal_each_alone_and_text_or_ids_alike(llm):
    params = BeamSearchParams(beam_width=4, max_tokens=6, length_penalty=0.5)
    together = llm.beam_search(PROMPTS, params)
    tokenizer = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, together):
        (alone,) = llm.beam_search(prompt, params)
        (by_ids,) = llm.beam_search([{"prompt_token_ids": tokenizer.encode(prompt)}], params)
        for other in (alone, by_ids):
            assert [s.tokens for s in other.sequences] == [s.tokens for s in out.sequences]
        assert len(out.sequences) == 4 and len({tuple(s.tokens) for s in out.sequences}) == 4
        assert all(s.text == tokenizer.decode(s.tokens) and s.text.startswith("<s>" + prompt) for s in out.sequences)
        assert all(len(s.logprobs) == len(s.tokens) - len(out.prompt_token_ids) for s in out.sequences)
        assert all(len(step) >= 8 for s in out.sequences for step in s.logprobs)  # 2 * beam_width candidates


def test_beams_stop_at_max_model_len(llm):
    prompt = {"prompt_token_ids": [5] * 250}  # room for 6 tokens in 256
    (out,) = llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=50, ignore_eos=True))
    assert [len(s.tokens) for s in out.sequences] == [256, 256]
    assert {s.finish_reason for s in out.sequences} == {"length"}


@pytest.mark.parametrize("prompts, params, match", [
    ("hi", SamplingParams(), "BeamSearchParams"),
    ({"prompt_token_ids": [5] * 300}, BeamSearchParams(beam_width=2, max_tokens=3), "max_model_len"),
    ({"prompt_token_ids": [1, 10**6]}, BeamSearchParams(beam_width=2, max_tokens=3), "out of range"),
    (5, BeamSearchParams(beam_width=2, max_tokens=3), "prompts must be"),
])
def test_bad_input_raises_value_error_and_the_engine_carries_on(llm, prompts, params, match):
    with pytest.raises(ValueError, match=match):
        llm.beam_search(prompts, params)
    assert not llm.llm_engine.has_unfinished_requests()
    (out,) = llm.beam_search("hi", BeamSearchParams(beam_width=2, max_tokens=2))
    assert len(out.sequences) == 2


def test_async_llm_matches_llm_and_cancelling_aborts_the_step(llama_path, llm):
    from halserve.config import EngineConfig
    from halserve.engine.async_llm import AsyncLLM

    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5)
    want = llm.beam_search(PROMPTS, params)

    async def main():
        engine = AsyncLLM.from_config(EngineConfig(model=llama_path, platform="cpu", dtype="float32", block_size=16,
                                                   max_model_len=256))
        try:
            got = await engine.beam_search(PROMPTS, params)
            long = BeamSearchParams(beam_width=10, max_tokens=240, ignore_eos=True)
            steps = engine.get_stats().num_steps
            task = asyncio.ensure_future(engine.beam_search(PROMPTS * 2, long))
            while engine.get_stats().num_steps < steps + 10:  # (a search step is a few engine steps)
                await asyncio.sleep(0.01)
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 10
            while (stats := engine.get_stats()).num_running or stats.num_waiting or engine._requests:
                assert time.monotonic() < deadline, f"the cancelled search's requests still run: {stats}"
                await asyncio.sleep(0.05)
            submitted = []
            original_submit = engine.submit

            async def counting_submit(prepared):
                submitted.append(prepared.request_id)
                return await original_submit(prepared)

            engine.submit = counting_submit
            await asyncio.sleep(0.5)
            assert submitted == []  # and no later search step was submitted
            assert not engine._requests
            return got
        finally:
            await engine.shutdown()

    got = asyncio.run(asyncio.wait_for(main(), 120))
    for a, b in zip(want, got):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.text for s in a.sequences] == [s.text for s in b.sequences]
        assert [s.cum_logprob for s in a.sequences] == pytest.approx([s.cum_logprob for s in b.sequences], abs=1e-4)
