import math

import pytest
import torch

from halserve.sampling import Sampler, SamplingMetadata
from halserve.sampling_params import SamplingParams

V = 32
sampler = Sampler()


def build(params, outputs=None, prompts=None, eos=(), vocab_size=V):
    n = len(params)
    return SamplingMetadata.build(
        params=params,
        prompt_token_ids=prompts or [[] for _ in range(n)],
        output_token_ids=outputs or [[] for _ in range(n)],
        vocab_size=vocab_size,
        device=torch.device("cpu"),
        eos_token_ids=eos,
    )


def rand_logits(rows, seed=0, vocab_size=V):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab_size, generator=g) * 3


def test_all_greedy_builds_nothing_and_takes_argmax():
    params = [SamplingParams(temperature=0.0) for _ in range(4)]
    meta = build(params)
    assert meta.all_greedy and meta.temperature is None and meta.top_k is None and not meta.has_penalties
    logits = rand_logits(4)
    sampled, logprobs = sampler(logits, meta)
    assert sampled.dtype == torch.int64 and sampled.shape == (4,)
    assert torch.equal(sampled, logits.argmax(-1))
    assert logprobs == [None] * 4


@pytest.mark.parametrize("width", [2047, 2048, 3000, 49152, 50000])
def test_row_max_is_torch_max_with_its_first_index(width):
    """The greedy rows' max (sampling.ops.row_max, chunked on the CPU for long rows) gives torch.max's values and
    indices: the first of tied maxima within and across chunks and in the tail past whole chunks, an all -inf
    row, +inf, and a NaN (which torch.max takes as the largest: its first index)."""
    from halserve.sampling.ops import row_max

    g = torch.Generator().manual_seed(width)
    x = torch.randn(12, width, generator=g)
    x[0] = float("-inf")
    x[1, 5], x[1, width - 1] = float("nan"), float("nan")
    x[2, 7], x[2, width - 1] = 9.0, 9.0
    x[3, width - 1] = 99.0
    x[4] = 3.0
    x[5, 1500], x[5, 100] = float("inf"), float("inf")
    x[6, 1030], x[6, 2000] = 50.0, 50.0
    want = x.max(dim=-1)
    values, indices = row_max(x)
    assert torch.equal(indices, want.indices)
    assert torch.equal(values.nan_to_num(), want.values.nan_to_num()) and values[1].isnan()


def test_sampler_does_not_modify_logits():
    params = [SamplingParams(temperature=0.7, top_k=3, top_p=0.5, min_p=0.1, repetition_penalty=1.3, min_tokens=2)]
    logits = rand_logits(1)
    before = logits.clone()
    sampler(logits, build(params, outputs=[[1, 2]], prompts=[[3]], eos=[4]))
    assert torch.equal(logits, before)


def test_greedy_rows_in_a_mixed_batch_take_argmax():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=5.0), SamplingParams(temperature=0.0, top_k=3)]
    logits = rand_logits(3)
    meta = build(params)
    assert not meta.all_greedy and not meta.all_random
    for _ in range(5):
        sampled, _ = sampler(logits, meta)
        assert sampled[0] == logits[0].argmax() and sampled[2] == logits[2].argmax()


def test_top_k_1_is_argmax():
    logits = rand_logits(6, seed=1)
    meta = build([SamplingParams(temperature=1.5, top_k=1) for _ in range(6)])
    for _ in range(10):
        assert torch.equal(sampler(logits, meta)[0], logits.argmax(-1))


def test_tiny_top_p_is_argmax():
    logits = rand_logits(6, seed=2)
    meta = build([SamplingParams(temperature=2.0, top_p=1e-6) for _ in range(6)])
    assert meta.top_p is not None and meta.top_k is None
    for _ in range(10):
        assert torch.equal(sampler(logits, meta)[0], logits.argmax(-1))


def test_top_k_and_top_p_together_keep_only_allowed_tokens():
    # probs 0.4, 0.3, 0.2, 0.1: top_p=0.6 keeps {0, 1}; top_k=3 alone keeps {0, 1, 2}
    kinds = [SamplingParams(top_p=0.6), SamplingParams(top_k=3), SamplingParams(top_k=3, top_p=0.6)]
    reps = 200  # independent draws as batch rows: one sampler call
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).repeat(3 * reps, 1)
    sampled = sampler(logits, build([p for p in kinds for _ in range(reps)], vocab_size=4))[0]
    seen = [set(sampled[i * reps:(i + 1) * reps].tolist()) for i in range(3)]
    assert seen == [{0, 1}, {0, 1, 2}, {0, 1}]


def test_top_k_only_per_row_values():
    reps = 100
    logits = rand_logits(3, seed=3).repeat(reps, 1)  # row i % 3 has kind i % 3
    kinds = [SamplingParams(top_k=2), SamplingParams(top_k=0), SamplingParams(top_k=5)]
    meta = build(kinds * reps)
    assert meta.max_top_k == 5 and meta.top_p is None
    allowed = [set(logits[0].topk(2).indices.tolist()), set(range(V)), set(logits[2].topk(5).indices.tolist())]
    for row, tok in enumerate(sampler(logits, meta)[0].tolist()):
        assert tok in allowed[row % 3]


def test_min_p_filters_unlikely_tokens():
    # probs 0.5, 0.3, 0.15, 0.05; min_p=0.25 -> threshold 0.125 keeps tokens 0, 1, 2
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    meta = build([SamplingParams(min_p=0.25)] * 400, vocab_size=4)
    assert set(sampler(logits, meta)[0].tolist()) == {0, 1, 2}
    meta = build([SamplingParams(min_p=0.7)] * 400, vocab_size=4)
    assert set(sampler(logits, meta)[0].tolist()) == {0}


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)]
    prompt, output = [0, 4], [1, 1, 2]
    meta = build(params, outputs=[output], prompts=[prompt], vocab_size=6)
    from halserve.sampling.ops import apply_penalties

    got = apply_penalties(
        logits, meta.output_token_counts, meta.prompt_token_mask,
        meta.repetition_penalty, meta.frequency_penalty, meta.presence_penalty,
    )
    # repetition over prompt+output {0, 1, 2, 4}: positive / 2, negative * 2
    rep = [2.0 / 2, -1.0 * 2, 0.5 / 2, 3.0, -2.0 * 2, 1.0]
    # frequency/presence over the output only: token 1 twice, token 2 once
    expected = list(rep)
    expected[1] -= 0.5 * 2 + 0.25
    expected[2] -= 0.5 * 1 + 0.25
    assert torch.allclose(got, torch.tensor([expected])), got
    # the prompt token 0 is not touched by presence/frequency, only repetition
    assert got[0, 0] == 1.0
    # greedy sampling follows the penalised logits: token 3 (3.0) beats token 0 (was 2.0, now 1.0)
    assert int(sampler(logits, meta)[0]) == 3


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[5.0, 4.9, 0.0]])
    meta = build([SamplingParams(temperature=0.0, presence_penalty=0.5)], outputs=[[0]], vocab_size=3)
    assert int(sampler(logits, meta)[0]) == 1


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.zeros(3, 8)
    logits[:, 7] = 10.0  # eos is the argmax
    logits[:, 6] = 9.0  # a stop token id is second
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6]),  # already has 3 outputs
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True),  # eos not a stop token
    ]
    meta = build(params, outputs=[[1, 2], [1, 2, 3], [1]], eos={7}, vocab_size=8)
    sampled, _ = sampler(logits, meta)
    assert sampled.tolist() == [0, 7, 7]
    # per-row eos collections are accepted too
    meta = build(params[:1], outputs=[[1]], eos=[{7}], vocab_size=8)
    assert int(sampler(logits[:1], meta)[0]) == 0


def test_logprobs_are_raw_log_softmax_with_ranks():
    logits = rand_logits(3, seed=4)
    top2 = logits[2].topk(2)
    logits[2, top2.indices[0]] = top2.values[1] + 0.5  # a presence penalty of 2 flips the top two
    params = [
        SamplingParams(temperature=0.9, logprobs=5, repetition_penalty=1.5, top_k=4),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0, presence_penalty=2.0),
    ]
    meta = build(params, outputs=[[0, 1], [], [int(logits[2].argmax())]])
    sampled, logprobs = sampler(logits, meta)
    assert logprobs[1] is None
    ref = torch.log_softmax(logits.double(), dim=-1)
    for row in (0, 2):
        entry = logprobs[row]
        tok = int(sampled[row])
        assert entry.token_id == tok
        assert math.isclose(entry.logprob, float(ref[row, tok]), abs_tol=1e-6)
        assert entry.rank == int((ref[row] > ref[row, tok]).sum()) + 1
    top = logprobs[0]
    assert top.top_token_ids == ref[0].topk(5).indices.tolist()
    for lp, want in zip(top.top_logprobs, ref[0].topk(5).values.tolist()):
        assert math.isclose(lp, want, abs_tol=1e-6)
    # logprobs=0: only the sampled token; the presence penalty pushed row 2 off its argmax -> rank 2
    assert logprobs[2].top_token_ids == [] and logprobs[2].rank == 2


def test_temperature_sampling_statistics():
    probs = torch.tensor([0.3, 0.7])
    logits = torch.log(probs).repeat(4000, 1)  # 4000 independent draws in one batch
    meta = build([SamplingParams(temperature=1.0)] * 4000, vocab_size=2)
    freq = sampler(logits, meta)[0].float().mean().item()
    assert abs(freq - 0.7) < 0.03  # ~4.1 standard deviations
    # temperature 2 flattens: p1 = 0.7^0.5 / (0.3^0.5 + 0.7^0.5) ~= 0.604
    meta = build([SamplingParams(temperature=2.0)] * 4000, vocab_size=2)
    freq = sampler(logits, meta)[0].float().mean().item()
    assert abs(freq - 0.604) < 0.035


def _run_seeded(params_list, row, steps=6, seed=11):
    """Sample `steps` tokens; every row sees the logits of its own request id, the seeded row at `row`."""
    outputs = [[] for _ in params_list]
    for step in range(steps):
        logits = torch.stack([rand_logits(1, seed=100 * step + (0 if i == row else 1 + i))[0] for i in range(len(params_list))])
        meta = build(params_list, outputs=[list(o) for o in outputs])
        sampled, _ = sampler(logits, meta)
        for i, tok in enumerate(sampled.tolist()):
            outputs[i].append(tok)
    return outputs[row]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    seeded = SamplingParams(temperature=1.0, seed=1234, top_p=0.95)
    alone = _run_seeded([seeded], row=0)
    assert alone == _run_seeded([seeded], row=0)
    others = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, seed=7)]
    in_batch = _run_seeded([others[0], others[1], seeded, others[2]], row=2)
    assert in_batch == alone
    # another seed gives another sequence (with overwhelming probability over 6 flat draws)
    assert _run_seeded([SamplingParams(temperature=1.0, seed=99, top_p=0.95)], row=0) != alone


def test_seeded_stream_depends_on_output_count_not_history():
    # a preempted request recomputed from scratch resumes with the same noise: only the count matters
    logits = rand_logits(1, seed=5)
    p = SamplingParams(temperature=1.0, seed=3)
    a = sampler(logits, build([p], outputs=[[1, 2, 3]]))[0]
    b = sampler(logits, build([p], outputs=[[9, 9, 9]]))[0]
    assert torch.equal(a, b)


def test_mismatched_shapes_are_value_errors():
    with pytest.raises(ValueError, match="do not match"):
        sampler(torch.zeros(2, V), build([SamplingParams()]))
    with pytest.raises(ValueError, match="one prompt and one output list per request"):
        SamplingMetadata.build([SamplingParams()], [[]], [], V, "cpu")
    with pytest.raises(ValueError, match="eos_token_ids"):
        build([SamplingParams(min_tokens=2)] * 2, eos=[{1}, {2}, {3}])


def test_logit_bias_moves_greedy_choice_and_only_in_its_row():
    logits = rand_logits(3, seed=5)
    low = int(logits[0].argmin())
    params = [SamplingParams(temperature=0.0, logit_bias={low: 100.0}), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias={int(logits[2].argmax()): -100.0})]
    meta = build(params)
    assert meta.disallowed is None and meta.bias_rows.tolist() == [0, 2]
    sampled, _ = sampler(logits, meta)
    assert sampled[0] == low  # the least likely token, pushed to the top
    assert sampled[1] == logits[1].argmax()  # a row without logit_bias is untouched
    assert sampled[2] == logits[2].topk(2).indices[1]  # the argmax pushed down: the runner-up wins


def test_logit_bias_comes_before_penalties_and_not_into_logprobs():
    logits = torch.zeros(1, V)
    logits[0, 7] = 1.0
    # +0.5 on token 3 and a presence penalty of 2 on token 7 (already generated): 3 wins
    meta = build([SamplingParams(temperature=0.0, logit_bias={3: 0.5}, presence_penalty=2.0, logprobs=1)],
                 outputs=[[7]])
    sampled, logprobs = sampler(logits, meta)
    assert sampled.tolist() == [3]
    # logprobs describe the model's own distribution (vLLM's default): the bias is not in them
    raw = logits.log_softmax(-1)[0]
    assert logprobs[0].token_id == 3 and math.isclose(logprobs[0].logprob, float(raw[3]), rel_tol=1e-6)


def test_allowed_token_ids_restrict_random_and_greedy_rows():
    allowed = [2, 9, 30]
    params = [SamplingParams(temperature=1.0, allowed_token_ids=allowed), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0, allowed_token_ids=[5])]
    meta = build(params)
    assert meta.disallowed.shape == (3, V) and not meta.disallowed[1].any()
    assert (~meta.disallowed[0]).nonzero().flatten().tolist() == allowed
    seen0, seen1 = set(), set()
    logits = torch.zeros(3, V)  # flat: without the restriction every token is as likely
    for _ in range(200):
        sampled, _ = sampler(logits, meta)
        seen0.add(int(sampled[0]))
        seen1.add(int(sampled[1]))
        assert sampled[2] == 5
    assert seen0 == set(allowed)  # only those, and each of them
    assert len(seen1) > 10  # the unrestricted row samples widely


def test_token_lists_ignore_ids_past_the_logits():
    # ids are checked against the vocabulary when a request is added; the metadata still
    # never indexes past the logits (a model whose logits are narrower than the tokenizer)
    meta = build([SamplingParams(temperature=0.0, logit_bias={V + 3: 5.0}, allowed_token_ids=[V + 1])])
    assert meta.bias_rows is None and meta.disallowed is None
    logits = rand_logits(1)
    assert sampler(logits, meta)[0] == logits[0].argmax()


def test_takes_argmax_only_names_the_rows_whose_logits_only_feed_an_argmax():
    from halserve.sampling import takes_argmax_only

    assert takes_argmax_only(SamplingParams(temperature=0.0), 0)
    assert takes_argmax_only(SamplingParams(temperature=0.0, min_tokens=3), 3)  # (min_tokens met: no masking)
    for changed in (dict(temperature=0.7), dict(temperature=0.0, logprobs=0), dict(temperature=0.0, presence_penalty=0.5),
                    dict(temperature=0.0, frequency_penalty=0.1), dict(temperature=0.0, repetition_penalty=1.1),
                    dict(temperature=0.0, logit_bias={5: 1.0}), dict(temperature=0.0, allowed_token_ids=[1, 2]),
                    dict(temperature=0.0, min_tokens=3)):
        assert not takes_argmax_only(SamplingParams(**changed), 0), changed
    bad = SamplingParams(temperature=0.0)
    bad.bad_words_token_ids = [[7]]
    assert not takes_argmax_only(bad, 0)
    structured = SamplingParams(temperature=0.0, structured_outputs={"choice": ["a", "b"]})
    assert not takes_argmax_only(structured, 0)
