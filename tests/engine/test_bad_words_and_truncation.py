"""bad_words (tokens that would complete a banned word are never sampled) and
truncate_prompt_tokens (only the prompt's last k tokens are used), through the offline LLM."""
from __future__ import annotations

import numpy as np
import pytest

from halserve import LLM, SamplingParams
from halserve.engine.processor import tokenize_bad_words

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

MAX_MODEL_LEN = 128
PROMPT = "the quick brown fox"
LONG_TEXT = "the quick brown fox jumps over the lazy dog " * 30  # ~330 tokens: over max_model_len


@pytest.fixture(scope="module")
def llm(checkpoint_factory):
    return LLM(checkpoint_factory("llama"), platform="cpu", dtype="float32", block_size=16,
               max_model_len=MAX_MODEL_LEN)


def greedy(llm, prompt, max_tokens=24, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)
    return llm.generate(prompt, params, use_tqdm=False)[0]


def words_of(tokenizer, token_ids):
    """(position, word) for each generated token that is a whole word on its own: a bad word
    whose token sequences include that one token."""
    vocab = len(tokenizer)
    for i, tid in enumerate(token_ids):
        word = tokenizer.decode([tid]).strip()
        if word.isalpha() and [tid] in tokenize_bad_words(tokenizer, [word], vocab):
            yield i, word


def test_a_banned_word_is_never_generated_where_greedy_would_generate_it(llm):
    tokenizer = llm.get_tokenizer()
    ref = greedy(llm, PROMPT).outputs[0].token_ids
    i, word = next(words_of(tokenizer, ref))
    banned = {seq[0] for seq in tokenize_bad_words(tokenizer, [word], len(tokenizer)) if len(seq) == 1}
    out = greedy(llm, PROMPT, bad_words=[word]).outputs[0].token_ids
    assert ref[i] in banned  # without the ban greedy generates it at i ...
    assert out[:i] == ref[:i] and not banned & set(out)  # ... with it, never: the same text up to there
    # (in a batch, only the request with bad_words is affected)
    both = llm.generate([PROMPT, PROMPT], [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                                           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                          bad_words=[word])], use_tqdm=False)
    assert [b.outputs[0].token_ids for b in both] == [ref, out]


def test_a_multi_token_bad_word_is_banned_only_right_after_its_prefix(llm):
    tokenizer = llm.get_tokenizer()
    prompts = [PROMPT, "hello world", "the model", "tell me about paris"]
    checked = 0
    for prompt in prompts:
        ref = greedy(llm, prompt, max_tokens=32).outputs[0].token_ids
        for i in range(len(ref) - 1):
            a, b = ref[i], ref[i + 1]
            word = tokenizer.decode([a, b])
            if not word.strip() or [a, b] not in tokenize_bad_words(tokenizer, [word], len(tokenizer)):
                continue
            out = greedy(llm, prompt, max_tokens=32, bad_words=[word]).outputs[0].token_ids
            assert out[: i + 1] == ref[: i + 1] and out[i + 1] != b  # its prefix is generated, not its end
            assert not any(out[j : j + 2] == [a, b] for j in range(len(out) - 1))
            if b in out:  # ... and its last token is generated where the prefix does not come before it
                return
            checked += 1
    pytest.fail(f"no two-token word of {checked} tried showed its last token generated elsewhere")


def test_bad_words_that_leave_no_token_end_the_request_and_the_engine_serves_on(llm):
    tokenizer = llm.get_tokenizer()
    ref = greedy(llm, PROMPT).outputs[0].token_ids
    i, word = next(words_of(tokenizer, ref))
    out = greedy(llm, PROMPT, bad_words=[word], allowed_token_ids=[ref[i]]).outputs[0]
    assert (out.token_ids, out.finish_reason) == ([], "stop")
    assert out.stop_reason == "the request's constraints leave no token to generate (allowed_token_ids with bad_words)"
    assert greedy(llm, PROMPT).outputs[0].token_ids == ref


def test_bad_words_past_the_vocabulary_or_without_tokens_are_value_errors(llm, monkeypatch):
    tokenizer = llm.get_tokenizer()
    fox = tokenize_bad_words(tokenizer, ["fox"], len(tokenizer))
    assert fox == [tokenizer.encode(w, add_special_tokens=False) for w in ("fox", " fox")]
    assert tokenize_bad_words(tokenizer, ["fox", " fox"], len(tokenizer)) == fox  # (deduplicated)
    processor = llm.llm_engine.input_processor
    monkeypatch.setattr(processor, "vocab_size", min(min(seq) for seq in fox))
    with pytest.raises(ValueError, match=r"bad_words tokenize to token ids \[.*past the model's vocabulary"):
        greedy(llm, PROMPT, bad_words=["fox"])
    monkeypatch.undo()
    with pytest.raises(ValueError, match="bad_words tokenize to more than 128 token sequences"):
        greedy(llm, PROMPT, bad_words=[f"w{i}" for i in range(65)])
    params = SamplingParams(bad_words=["fox"])
    assert greedy(llm, PROMPT, bad_words=["fox"]).outputs[0].token_ids
    llm.generate(PROMPT, params, use_tqdm=False)
    assert params.bad_words_token_ids is None  # (the caller's params are not changed)


def test_truncation_gives_what_the_last_k_tokens_give(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(LONG_TEXT)
    assert len(ids) > MAX_MODEL_LEN
    with pytest.raises(ValueError, match="the model.s maximum context length"):
        greedy(llm, LONG_TEXT)  # (today's answer without truncation)
    for k in (1, 50, MAX_MODEL_LEN - 1):
        direct = greedy(llm, {"prompt_token_ids": ids[-k:]})
        for prompt in (LONG_TEXT, {"prompt_token_ids": ids}):
            cut = greedy(llm, prompt, truncate_prompt_tokens=k)
            assert cut.prompt_token_ids == ids[-k:] and cut.prompt is None
            assert cut.outputs[0].token_ids == direct.outputs[0].token_ids
    # -1 keeps what leaves room for max_tokens: max_model_len - max_tokens
    cut = greedy(llm, LONG_TEXT, max_tokens=8, truncate_prompt_tokens=-1)
    kept = ids[-(MAX_MODEL_LEN - 8):]
    assert cut.prompt_token_ids == kept
    assert cut.outputs[0].token_ids == greedy(llm, {"prompt_token_ids": kept}, 8).outputs[0].token_ids
    # a prompt within k is unchanged; n samples share the truncated prompt
    short = greedy(llm, PROMPT, truncate_prompt_tokens=50)
    assert short.prompt == PROMPT and short.prompt_token_ids == tokenizer.encode(PROMPT)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, truncate_prompt_tokens=20)
    (both,) = llm.generate(LONG_TEXT, params, use_tqdm=False)
    assert both.prompt_token_ids == ids[-20:] and len(both.outputs) == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"truncate_prompt_tokens": MAX_MODEL_LEN + 1},
     f"truncate_prompt_tokens value ({MAX_MODEL_LEN + 1}) is greater than max_model_len ({MAX_MODEL_LEN})"),
    ({"truncate_prompt_tokens": MAX_MODEL_LEN},
     f"truncate_prompt_tokens={MAX_MODEL_LEN} keeps {MAX_MODEL_LEN} tokens but a prompt may have at most "
     f"max_model_len - 1 = {MAX_MODEL_LEN - 1}"),
    ({"truncate_prompt_tokens": -1, "max_tokens": MAX_MODEL_LEN}, "truncate_prompt_tokens=-1 keeps max_model_len"),
])
def test_truncation_errors_are_value_errors(llm, kwargs, message):
    with pytest.raises(ValueError) as info:
        llm.generate(LONG_TEXT, SamplingParams(**kwargs), use_tqdm=False)
    assert message in str(info.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_embed_truncation_embeds_the_last_k_tokens(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(LONG_TEXT)
    with pytest.raises(ValueError, match="an embedding input may have at most"):
        llm.embed(LONG_TEXT, use_tqdm=False)
    (cut,) = llm.embed(LONG_TEXT, truncate_prompt_tokens=40, use_tqdm=False)
    (direct,) = llm.embed({"prompt_token_ids": ids[-40:]}, use_tqdm=False)
    assert cut.prompt_token_ids == ids[-40:]
    assert np.allclose(cut.outputs.embedding, direct.outputs.embedding, atol=1e-6)
    (whole,) = llm.embed(LONG_TEXT, truncate_prompt_tokens=-1, use_tqdm=False)
    assert whole.prompt_token_ids == ids[-MAX_MODEL_LEN:]  # (an embedding input may fill the context)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1, or -1"):
        llm.embed(LONG_TEXT, truncate_prompt_tokens=0, use_tqdm=False)


def test_the_offline_llm_stops_a_max_tokens_past_the_context_at_its_end(llm):
    """Offline (as vLLM's LLM) a max_tokens larger than the context leaves is cut to that room; the server refuses
    it with a 400 instead (tests/entrypoints/test_server_bad_words_truncation.py)."""
    ids = list(range(100, 140))
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=10 * MAX_MODEL_LEN, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == MAX_MODEL_LEN - len(ids) and out.finish_reason == "length"
