"""worker/step_inputs.py: the decode-only fast path builds exactly the general path's inputs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from halserve.sampling_params import SamplingParams
from halserve.scheduler_output import CachedRequestData, SchedulerOutput
from halserve.worker import step_inputs
from halserve.worker.runner_state import CachedRequestState

BLOCK_SIZE = 4


def _state(req_id: str, num_prompt: int, num_output: int, num_computed: int, **params) -> CachedRequestState:
    rng = np.random.default_rng(len(req_id) * 7 + num_prompt)
    num_tokens = num_prompt + num_output
    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=rng.integers(3, 500, num_prompt).tolist(),
        output_token_ids=rng.integers(3, 500, num_output).tolist(),
        sampling_params=SamplingParams(**params),
        block_ids=rng.permutation(np.arange(1, 100))[: -(-num_tokens // BLOCK_SIZE)].tolist(),
        num_computed_tokens=num_computed,
    )


def _step(states: list[CachedRequestState], num_scheduled: list[int]) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=[CachedRequestData(s.req_id, [], s.num_computed_tokens) for s in states],
        num_scheduled_tokens={s.req_id: n for s, n in zip(states, num_scheduled)},
        total_num_scheduled_tokens=sum(num_scheduled),
    )


def _general(monkeypatch, out, requests):
    with monkeypatch.context() as m:
        m.setattr(step_inputs, "_prepare_decode", lambda *args: None)
        return step_inputs.prepare_inputs(out, requests, BLOCK_SIZE, supports_pooling=True)


def _assert_same(fast, general) -> None:
    for name in ("input_ids", "positions", "logits_indices"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert np.array_equal(fast.seq_lens, general.seq_lens) and fast.seq_lens.dtype == general.seq_lens.dtype
    assert (fast.req_ids, fast.sample_rows, fast.pool_rows) == (general.req_ids, general.sample_rows, general.pool_rows)
    assert (fast.sample_drafts, fast.prompt_indices, fast.group_common) == (None, [], None)
    fc, gc = fast.common, general.common
    for name in ("num_actual_tokens", "num_reqs", "max_query_len", "max_seq_len"):
        assert getattr(fc, name) == getattr(gc, name), name
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "query_start_loc_cpu", "seq_lens_cpu"):
        a, b = getattr(fc, name), getattr(gc, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("shape", [
    [(7, 0)],  # one stream, its first decode step (the prompt's last token): num_computed = 6
    [(5, 9)],  # one stream mid-decode, its position on a block boundary
    [(3, 1), (12, 30), (1, 0), (8, 4)],  # a batch of different lengths (blocks tables of different widths)
])
def test_decode_fast_path_matches_general_path(monkeypatch, shape):
    states = [_state(f"r{i}", p, o, p + o - 1) for i, (p, o) in enumerate(shape)]
    requests = {s.req_id: s for s in states}
    out = _step(states, [1] * len(states))
    fast = step_inputs.prepare_inputs(out, requests, BLOCK_SIZE, supports_pooling=True)
    assert step_inputs._prepare_decode(out, fast.req_ids, fast.states, BLOCK_SIZE) is not None  # (the fast path ran)
    _assert_same(fast, _general(monkeypatch, out, requests))
    assert fast.input_ids.tolist() == [(s.output_token_ids or s.prompt_token_ids)[-1] for s in states]


@pytest.mark.parametrize("case", ["prefill_chunk", "mid_prefill", "prompt_logprobs", "pooling"])
def test_decode_fast_path_declines_other_steps(case):
    decoding = _state("a", 4, 3, 6)
    if case == "prefill_chunk":  # two prompt tokens in one step
        other, num_scheduled = _state("b", 6, 0, 4), 2
    elif case == "mid_prefill":  # one token, not the last known one: it samples nothing
        other, num_scheduled = _state("b", 6, 0, 2), 1
    elif case == "prompt_logprobs":
        other, num_scheduled = _state("b", 6, 0, 5), 1
        other.prompt_logprobs = []
    else:
        from halserve.pooling_params import PoolingParams

        other, num_scheduled = _state("b", 6, 0, 5), 1
        other.sampling_params.pooling = PoolingParams()
    states = [decoding, other]
    out = _step(states, [1, num_scheduled])
    assert step_inputs._prepare_decode(out, ["a", "b"], states, BLOCK_SIZE) is None


def test_placeholder_tokens_on_both_paths(monkeypatch):
    """Async scheduling: a request scheduled one token past what the worker knows (the step before's
    token, still on the device) gets a placeholder input (0, filled on the device) at its index, samples,
    and the rest of the step is what the general path builds; the decode fast path takes it too."""
    behind = _state("behind", 5, 2, 7)  # computed == known: its next input is the placeholder
    level = _state("level", 9, 0, 8)  # its prompt's last token (known)
    behind2 = _state("behind2", 3, 0, 3)  # its first token is in flight
    states = [behind, level, behind2]
    requests = {s.req_id: s for s in states}
    out = _step(states, [1, 1, 1])
    fast = step_inputs.prepare_inputs(out, requests, BLOCK_SIZE, supports_pooling=True)
    assert step_inputs._prepare_decode(out, fast.req_ids, fast.states, BLOCK_SIZE) is not None
    general = _general(monkeypatch, out, requests)
    _assert_same(fast, general)
    for inputs in (fast, general):
        assert inputs.placeholder_indices == [0, 2] and inputs.placeholder_req_ids == ["behind", "behind2"]
        assert inputs.input_ids.tolist() == [0, level.prompt_token_ids[-1], 0]
        assert inputs.positions.tolist() == [7, 8, 3] and inputs.sample_rows == [0, 1, 2]

    # a chunk ahead of it in the batch moves its index; a token two past the known ones is a bug
    chunk = _state("chunk", 12, 0, 4)
    requests["chunk"] = chunk
    out = _step([chunk, behind], [5, 1])
    mixed = step_inputs.prepare_inputs(out, requests, BLOCK_SIZE, supports_pooling=True)
    assert mixed.placeholder_indices == [5] and mixed.placeholder_req_ids == ["behind"]
    assert mixed.input_ids.tolist() == chunk.prompt_token_ids[4:9] + [0] and mixed.sample_rows == [1]
    with pytest.raises(AssertionError, match="'behind' is scheduled up to token 9 but the worker knows 7"):
        step_inputs.prepare_inputs(_step([behind], [2]), requests, BLOCK_SIZE, supports_pooling=True)
