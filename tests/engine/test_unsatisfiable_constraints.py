"""Constraints that leave a request no token (a grammar with allowed_token_ids, an empty
grammar) end it without breaking them; min_tokens gives way to a complete structured output.
The other requests of the batch are unaffected and the engine serves on."""
from __future__ import annotations

import logging

import pytest

from halserve import LLM, SamplingParams

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

NO_TOKEN = "the request's constraints leave no token to generate"


@pytest.fixture(scope="module")
def llm(checkpoint_factory):
    return LLM(checkpoint_factory("llama"), platform="cpu", dtype="float32", block_size=16, max_model_len=128)


def _result(out):
    o = out.outputs[0]
    return o.text, o.token_ids, o.finish_reason, o.stop_reason


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "random"])
def test_conflicting_constraints_end_the_request_without_breaking_them(llm, temperature, caplog):
    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_id
    (a_id,) = tokenizer.encode("a", add_special_tokens=False)
    base = dict(temperature=temperature, seed=11)
    conflicting = {
        # no string derives from root: nothing is legal from the first token
        "empty grammar": SamplingParams(**base, max_tokens=10, structured_outputs={"grammar": 'root ::= root "a"'}),
        # no allowed token starts "alpha"
        "choice + allowed_token_ids": SamplingParams(**base, max_tokens=5, allowed_token_ids=[5],
                                                     structured_outputs={"choice": ["alpha"]}),
    }
    complete = {
        # "a" is complete after one token: EOS is all the grammar allows, min_tokens gives way
        "choice + min_tokens": SamplingParams(**base, max_tokens=6, min_tokens=4, structured_outputs={"choice": ["a"]}),
        # "a" is complete and EOS not allowed: it ends as if EOS had been sampled
        "choice + allowed_token_ids without EOS": SamplingParams(**base, max_tokens=6, allowed_token_ids=[a_id],
                                                                 structured_outputs={"choice": ["a"]}),
    }
    ordinary = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, min_tokens=8),
        SamplingParams(temperature=1.0, seed=5, max_tokens=8, structured_outputs={"choice": ["yes", "no"]}),
    ]
    prompts = ["hi", "the quick brown fox", "tell me"]
    alone = [_result(llm.generate(p, sp, use_tqdm=False)[0]) for p, sp in zip(prompts, ordinary)]

    special = {**conflicting, **complete}
    with caplog.at_level(logging.WARNING, logger="halserve.worker.model_runner"):
        outs = llm.generate(["hi"] * len(special) + prompts, [*special.values(), *ordinary], use_tqdm=False)
    results = dict(zip(special, map(_result, outs)))

    for name in conflicting:
        text, token_ids, finish_reason, stop_reason = results[name]
        assert (text, token_ids, finish_reason) == ("", [], "stop"), name  # no token breaks the constraint
        assert stop_reason.startswith(NO_TOKEN), name
    assert results["empty grammar"][3] == f"{NO_TOKEN} (structured outputs)"
    assert results["choice + allowed_token_ids"][3] == f"{NO_TOKEN} (structured outputs with allowed_token_ids)"
    assert results["choice + min_tokens"] == ("a", [a_id, eos], "stop", None)
    assert results["choice + allowed_token_ids without EOS"] == ("a", [a_id], "stop", None)
    # each conflict is logged once, naming its request
    warned = [r.getMessage() for r in caplog.records if NO_TOKEN in r.getMessage()]
    assert len(warned) == len(conflicting) and all(m.startswith("request ") for m in warned), warned

    # the batch's other requests got what they get alone
    assert [_result(o) for o in outs[len(special):]] == alone
    # each special request alone gives the same as in the batch, and the engine serves on
    for name, params in special.items():
        assert _result(llm.generate("hi", params, use_tqdm=False)[0]) == results[name], name
    assert not llm.llm_engine.has_unfinished_requests()
    assert [_result(llm.generate(p, sp, use_tqdm=False)[0]) for p, sp in zip(prompts, ordinary)] == alone
