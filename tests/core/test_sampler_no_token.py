"""Sampler rows whose hard constraints (-inf logits) leave nothing: reported, never mixed
into the other rows; min_tokens gives way when only stop tokens are left."""
import pytest
import torch

from halserve.sampling import Sampler, SamplingMetadata
from halserve.sampling_params import SamplingParams

V = 16
EOS = 15
sampler = Sampler()


def build(params, outputs):
    return SamplingMetadata.build(params=params, prompt_token_ids=[[] for _ in params], output_token_ids=outputs,
                                  vocab_size=V, device=torch.device("cpu"), eos_token_ids={EOS})


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "random"])
def test_a_row_without_tokens_is_reported_and_the_others_sample_as_alone(temperature):
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    logits[1] = float("-inf")  # (a grammar mask that allows nothing)
    params = [SamplingParams(temperature=temperature, seed=s, top_p=0.9, logprobs=1) for s in range(3)]
    out = sampler.sample(logits, build(params, [[] for _ in params]))
    assert out.has_token.tolist() == [True, False, True] and out.min_tokens_waived is None
    for row in (0, 2):
        alone = sampler.sample(logits[row : row + 1], build(params[row : row + 1], [[]]))
        assert int(out.sampled_token_ids[row]) == int(alone.sampled_token_ids[0])
        assert out.logprobs[row] == alone.logprobs[0]


def test_min_tokens_gives_way_when_only_stop_tokens_are_left():
    logits = torch.zeros(3, V)
    logits[0, :EOS] = float("-inf")  # only EOS is allowed: min_tokens gives way
    logits[1, 1:EOS] = float("-inf")  # token 0 or EOS: min_tokens holds EOS off
    logits[1, EOS] = 5.0
    logits[2, EOS] = 5.0  # no min_tokens left: EOS
    params = [SamplingParams(temperature=0.0, min_tokens=3)] * 3
    out = sampler.sample(logits, build(params, [[1], [1], [1, 2, 3]]))
    assert out.sampled_token_ids.tolist() == [EOS, 0, EOS]
    assert out.has_token.tolist() == [True, True, True]
    assert out.min_tokens_waived.tolist() == [True, False, False]
