"""bad_words in the sampler: a banned sequence's last token is -inf where the output ends with
the rest of it (vLLM's rule), in its own row only; a ban that leaves nothing is reported."""
import pytest
import torch

from halserve.sampling import Sampler, SamplingMetadata
from halserve.sampling_params import SamplingParams

V = 16
EOS = 15
sampler = Sampler()


def params_with_bans(sequences, **kwargs):
    params = SamplingParams(temperature=0.0, **kwargs)
    params.bad_words_token_ids = sequences  # (what the InputProcessor sets from bad_words)
    return params


def build(params, outputs):
    return SamplingMetadata.build(params=params, prompt_token_ids=[[] for _ in params], output_token_ids=outputs,
                                  vocab_size=V, device=torch.device("cpu"), eos_token_ids={EOS})


def ranked_logits(rows):
    """Token t has logit t in every row, EOS the lowest: greedy picks the highest id not banned."""
    logits = torch.arange(V, dtype=torch.float32).repeat(rows, 1)
    logits[:, EOS] = -1.0
    return logits


def test_one_token_ban_holds_at_every_step_and_only_in_its_row():
    params = [params_with_bans([[14], [13]]), SamplingParams(temperature=0.0)]
    for output in ([], [3], [14, 13, 2]):
        out = sampler.sample(ranked_logits(2), build(params, [output, output]))
        assert out.sampled_token_ids.tolist() == [12, 14] and out.has_token.tolist() == [True, True]


@pytest.mark.parametrize("output, banned", [
    ([], False),  # the prefix is longer than the output
    ([4], False),
    ([5], False),  # only part of the prefix
    ([4, 5], True),
    ([9, 9, 4, 5], True),
    ([4, 5, 9], False),  # the prefix must end the output
    ([5, 4], False),
])
def test_multi_token_ban_holds_only_right_after_its_prefix(output, banned):
    params = [params_with_bans([[4, 5, 14]])]
    out = sampler.sample(ranked_logits(1), build(params, [output]))
    assert out.sampled_token_ids.tolist() == [13 if banned else 14]


def test_random_rows_never_draw_a_banned_token_and_logprobs_stay_raw():
    logits = torch.zeros(2, V)
    logits[:, 7] = 4.0  # the likeliest token by far, banned in row 0
    params = [params_with_bans([[7], [2, 3]], logprobs=1), SamplingParams(temperature=1.0, seed=1)]
    params[0].temperature = 1.0
    drawn = set()
    for seed in range(200):
        params[0].seed = params[1].seed = seed
        out = sampler.sample(logits, build(params, [[2], [2]]))
        drawn.add(int(out.sampled_token_ids[0]))
    assert drawn and not drawn & {7, 3}
    assert out.logprobs[0].top_token_ids == [7]  # logprobs are the model's: taken before any ban


def test_no_bad_words_builds_no_ban_and_ids_past_the_logits_are_ignored():
    assert build([SamplingParams(temperature=0.0)], [[1]]).banned_rows is None
    assert build([params_with_bans([[1, 2]])], [[3]]).banned_rows is None  # the prefix is not there
    meta = build([params_with_bans([[V + 3], [1, V]])], [[1]])
    assert meta.banned_rows is None
    out = sampler.sample(ranked_logits(1), meta)
    assert out.sampled_token_ids.tolist() == [14]


def test_bans_that_leave_no_token_are_reported_and_stop_tokens_end_min_tokens():
    params = [
        params_with_bans([[3]], allowed_token_ids=[3]),  # nothing left
        params_with_bans([[t] for t in range(EOS)], min_tokens=5),  # only EOS is left: min_tokens gives way
        params_with_bans([[3]]),
    ]
    out = sampler.sample(ranked_logits(3), build(params, [[], [], []]))
    assert out.has_token.tolist() == [False, True, True]
    assert out.sampled_token_ids.tolist()[1:] == [EOS, 14]
    assert out.min_tokens_waived.tolist() == [False, True, False]
