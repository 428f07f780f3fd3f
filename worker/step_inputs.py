"""One step's flattened model inputs, built on the host from the SchedulerOutput and the
runner's per-request state (the layout is drawn atop ``model_runner``)."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from halserve.attention_backends.base import AttentionMetadata
from halserve.scheduler_output import SchedulerOutput
from halserve.worker.runner_state import CachedRequestState, StepInputs


def prepare_inputs(out: SchedulerOutput, requests: dict[str, CachedRequestState], block_size: int,
                   supports_pooling: bool, num_kv_groups: int = 1) -> StepInputs:
    """Host-side (numpy/CPU tensors) flattened inputs of one step; ``num_kv_groups`` > 1: a hybrid
    model, whose groups 1.. get their own block table and slot mapping (``StepInputs.group_common``)."""
    req_ids = [r.req_id for r in out.scheduled_new_reqs] + [r.req_id for r in out.scheduled_cached_reqs]
    states = [requests[i] for i in req_ids]
    spec = out.scheduled_spec_decode_tokens
    if not spec and num_kv_groups == 1:
        decode = _prepare_decode(out, req_ids, states, block_size)
        if decode is not None:
            return decode
    num_reqs = len(states)
    bs = block_size

    num_sched = np.fromiter((out.num_scheduled_tokens[i] for i in req_ids), dtype=np.int64, count=num_reqs)
    computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=num_reqs)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(num_sched, out=query_start_loc[1:])
    total = int(query_start_loc[-1])
    seq_lens = computed + num_sched

    # positions: c_r + (t - query_start_loc[r]) for each token t of request r
    req_of_token = np.repeat(np.arange(num_reqs), num_sched)
    positions = np.arange(total, dtype=np.int64) + np.repeat(computed - query_start_loc[:-1], num_sched)

    token_ids: list[int] = []
    placeholder_indices: list[int] = []
    placeholder_req_ids: list[str] = []
    prompt_indices: list[int] = []
    prompt_targets: list[int] = []
    prompt_spans: list[tuple[int, int]] = []
    max_blocks = int(-(-seq_lens.max() // bs))
    block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)  # 0 = null block
    for r, state in enumerate(states):
        c, n = int(computed[r]), int(num_sched[r])
        drafts = spec.get(state.req_id) if spec else None
        if drafts:  # its last token, then the drafts to check
            token_ids.extend(state.token_slice(c, c + n - len(drafts)))
            token_ids.extend(drafts)
        elif c + n > state.num_tokens:  # async scheduling: its last token is the step before's (placeholder)
            _check_placeholder(state, c, n)
            token_ids.extend(state.token_slice(c, c + n - 1))
            placeholder_indices.append(len(token_ids))
            placeholder_req_ids.append(state.req_id)
            token_ids.append(0)  # (filled on the device)
        else:
            token_ids.extend(state.token_slice(c, c + n))
        if state.prompt_logprobs is not None:
            # the logits at position p score prompt token p + 1 (the last prompt position
            # scores the first output token: that is the sampled token's logprob)
            stop = min(c + n, len(state.prompt_token_ids) - 1)
            if stop > c:
                first = int(query_start_loc[r])
                prompt_indices.extend(range(first, first + stop - c))
                prompt_targets.extend(state.prompt_token_ids[c + 1 : stop + 1])
                prompt_spans.append((r, stop - c))
        ids = state.block_ids[:max_blocks]
        block_table[r, : len(ids)] = ids
    slot_mapping = block_table[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs

    # Requests that reach the end of their known tokens produce a new token, or, pooling
    # requests, their pooled result.
    # (a placeholder is the last token: its request reaches the end of its known tokens and samples)
    num_tokens = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=num_reqs)
    done_mask = seq_lens >= num_tokens
    is_pooling = np.fromiter((supports_pooling and s.sampling_params.pooling is not None for s in states),
                             dtype=bool, count=num_reqs)
    sample_mask, pool_mask = done_mask & ~is_pooling, done_mask & is_pooling
    sample_rows = [r for r in range(num_reqs) if sample_mask[r]]
    logits_indices = query_start_loc[1:][sample_mask] - 1
    sample_drafts = None
    if spec:  # a request with k drafts samples at its last k + 1 positions
        sample_drafts = [spec.get(states[r].req_id, []) for r in sample_rows]
        logits_indices = np.concatenate(
            [np.arange(end - len(d), end + 1) for end, d in zip(logits_indices, sample_drafts)]
        ).astype(np.int64)
    qsl_cpu = torch.from_numpy(query_start_loc.astype(np.int32))
    seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
    common = AttentionMetadata(
        num_actual_tokens=total,
        num_reqs=num_reqs,
        max_query_len=int(num_sched.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=qsl_cpu,
        seq_lens=seq_lens_cpu,
        block_table=torch.from_numpy(block_table),
        slot_mapping=torch.from_numpy(slot_mapping),
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=seq_lens_cpu,
    )
    group_common = None
    if num_kv_groups > 1:
        group_common = []
        for g in range(num_kv_groups - 1):
            # (a recurrent group's table is its state's blocks, whatever the context: maybe more than max_blocks)
            width = max(max_blocks, max(len(state.group_block_ids[g]) for state in states))
            table = np.zeros((num_reqs, width), dtype=np.int32)
            for r, state in enumerate(states):
                ids = state.group_block_ids[g][:width]
                table[r, : len(ids)] = ids
            slots = table[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs
            group_common.append(dataclasses.replace(common, block_table=torch.from_numpy(table),
                                                    slot_mapping=torch.from_numpy(slots)))
    return StepInputs(
        group_common=group_common,
        req_ids=req_ids,
        states=states,
        input_ids=torch.tensor(token_ids, dtype=torch.long),
        positions=torch.from_numpy(positions),
        common=common,
        seq_lens=seq_lens,
        sample_rows=sample_rows,
        logits_indices=torch.from_numpy(logits_indices),
        sample_drafts=sample_drafts,
        pool_rows=[r for r in range(num_reqs) if pool_mask[r]],
        pool_indices=torch.from_numpy(query_start_loc[1:][pool_mask] - 1),
        prompt_indices=prompt_indices,
        prompt_targets=prompt_targets,
        prompt_spans=prompt_spans,
        placeholder_indices=placeholder_indices,
        placeholder_req_ids=placeholder_req_ids,
    )


def _check_placeholder(state: CachedRequestState, computed: int, num_scheduled: int) -> None:
    """A request's tokens past its known ones: only its next one, the step before's sampled token
    (async scheduling gives a request at most one token in flight)."""
    if computed + num_scheduled != state.num_tokens + 1 or state.prompt_logprobs is not None:
        raise AssertionError(
            f"request {state.req_id!r} is scheduled up to token {computed + num_scheduled} but the worker knows "
            f"{state.num_tokens}: only the one token the step before samples may be unknown (a placeholder)")


def _prepare_decode(out: SchedulerOutput, req_ids: list[str], states: list[CachedRequestState],
                    block_size: int) -> StepInputs | None:
    """``prepare_inputs`` for a decode-only step (each request one token, its last known one, which it
    samples after; no drafts, prompt logprobs or pooling), or None for any other step. The same inputs
    as the general path with a fraction of its array ops: one token per request makes
    ``query_start_loc`` and ``logits_indices`` aranges and ``positions`` the computed counts (most
    single-stream decode steps)."""
    num_scheduled = out.num_scheduled_tokens
    token_ids: list[int] = []
    computed: list[int] = []
    placeholder_indices: list[int] = []
    placeholder_req_ids: list[str] = []
    for r, (req_id, state) in enumerate(zip(req_ids, states)):
        c = state.num_computed_tokens
        known = state.num_tokens
        if (num_scheduled[req_id] != 1 or c + 1 < known or c > known or state.prompt_logprobs is not None
                or state.sampling_params.pooling is not None):
            return None
        if c == known:  # async scheduling: the token the step before samples (a placeholder, filled on the device)
            placeholder_indices.append(r)
            placeholder_req_ids.append(req_id)
            token_ids.append(0)
        else:  # token c is the last known one: the last output, or the prompt's last before any output
            token_ids.append(state.output_token_ids[-1] if state.output_token_ids else state.prompt_token_ids[-1])
        computed.append(c)
    num_reqs = len(states)
    positions = np.array(computed, dtype=np.int64)  # [R]: one token per request, at its computed count
    seq_lens = positions + 1
    max_seq_len = int(seq_lens.max())
    max_blocks = -(-max_seq_len // block_size)
    block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)  # 0 = null block
    for r, state in enumerate(states):
        ids = state.block_ids[:max_blocks]
        block_table[r, : len(ids)] = ids
    rows = np.arange(num_reqs)
    slot_mapping = block_table[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    qsl_cpu = torch.arange(num_reqs + 1, dtype=torch.int32)  # [R + 1]: 0 1 .. R
    seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
    common = AttentionMetadata(
        num_actual_tokens=num_reqs,
        num_reqs=num_reqs,
        max_query_len=1,
        max_seq_len=max_seq_len,
        query_start_loc=qsl_cpu,
        seq_lens=seq_lens_cpu,
        block_table=torch.from_numpy(block_table),
        slot_mapping=torch.from_numpy(slot_mapping),
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=seq_lens_cpu,
    )
    return StepInputs(
        req_ids=req_ids,
        states=states,
        input_ids=torch.tensor(token_ids, dtype=torch.long),
        positions=torch.from_numpy(positions),
        common=common,
        seq_lens=seq_lens,
        sample_rows=list(range(num_reqs)),
        logits_indices=torch.from_numpy(rows.astype(np.int64)),  # every token samples
        pool_indices=torch.empty(0, dtype=torch.int64),
        placeholder_indices=placeholder_indices,
        placeholder_req_ids=placeholder_req_ids,
    )
