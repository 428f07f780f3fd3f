"""The model runner's pooling of embedding and classify requests (``halserve.pooling_params``).

A prompt may be prefilled over several steps (chunked prefill), so MEAN and CLS fold each
step's prompt rows into the request's runner state as they go, never keeping whole chunks::

    step k:  request r's rows hidden[q_r : q_r + n_r] are prompt positions c_r .. c_r + n_r - 1
    MEAN     total += sum of the rows of prompt positions (float32)      -> total / num_prompt
    CLS      first  = the row of position 0 (only in the step with c_r == 0)
    LAST     nothing kept: the step that reaches the prompt's end has its last row

The request's state starts empty whenever it (re)starts (a resume after preemption is a
new state), and MEAN/CLS requests never start from a prefix-cache hit (``KVCacheManager``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

    from halserve.worker.runner_state import CachedRequestState, StepInputs


@dataclass(slots=True)
class PromptPool:
    """A MEAN or CLS request's prompt rows pooled so far."""

    vector: torch.Tensor  # [hidden] float32: MEAN the sum of the rows so far, CLS the first row
    num_rows: int  # prompt positions folded in (0 .. num_rows - 1)


def accumulate_prompt_rows(
    states: list[CachedRequestState], query_start_loc: torch.Tensor, seq_lens: np.ndarray, hidden: torch.Tensor
) -> None:
    """Fold this step's prompt rows of ``hidden`` [T, hidden] into ``state.prompt_pool`` of each
    MEAN or CLS embedding request. ``query_start_loc`` [R+1] and ``seq_lens`` [R] are the step's
    (host) batch layout: request r's rows are q_r .. q_{r+1}-1, its context after the step seq_lens[r]."""
    for r, state in enumerate(states):
        params = state.sampling_params.pooling
        if params is None or not params.reads_whole_prompt:
            continue
        start, stop = int(query_start_loc[r]), int(query_start_loc[r + 1])
        computed = int(seq_lens[r]) - (stop - start)  # prompt positions before this step
        num_prompt_rows = min(stop - start, len(state.prompt_token_ids) - computed)
        if num_prompt_rows <= 0:
            continue
        pooled = state.prompt_pool
        assert computed == (pooled.num_rows if pooled is not None else 0), (
            f"{state.req_id}: pooling rows from position {computed} but {pooled.num_rows if pooled else 0} "
            "were pooled (a prefix-cache hit or a skipped chunk)"
        )
        if params.pooling_type == "CLS":
            if pooled is None:
                state.prompt_pool = PromptPool(hidden[start].float().clone(), num_prompt_rows)
            else:
                pooled.num_rows += num_prompt_rows
        else:  # MEAN
            total = hidden[start : start + num_prompt_rows].float().sum(dim=0)
            if pooled is None:
                state.prompt_pool = PromptPool(total, num_prompt_rows)
            else:
                pooled.vector += total
                pooled.num_rows += num_prompt_rows


def pool(last_rows: torch.Tensor, states: list[CachedRequestState], model: torch.nn.Module) -> list[list[float]]:
    """Results of the pooling requests that finish their prompt this step: ``last_rows``
    [R, hidden] is each one's hidden state at its last prompt token (what LAST pools); MEAN
    and CLS read what ``accumulate_prompt_rows`` kept, which covers the whole prompt by now.
    An embedding request gets its pooled row (cut, normalized); a classify request the
    classifier ``model``'s class probabilities of it (raw logits without activation)."""
    out: list[list[float]] = []
    classify: list[tuple[int, torch.Tensor]] = []  # (index in out, pooled row [hidden] float32)
    for row, state in zip(last_rows, states):
        params = state.sampling_params.pooling
        if params.reads_whole_prompt:
            pooled, num_prompt = state.prompt_pool, len(state.prompt_token_ids)
            assert pooled is not None and pooled.num_rows == num_prompt, (
                f"{state.req_id}: pooled {pooled.num_rows if pooled else 0} of {num_prompt} prompt rows"
            )
            vec = pooled.vector / num_prompt if params.pooling_type == "MEAN" else pooled.vector
            state.prompt_pool = None
        else:  # LAST (also when the engine left the type unset)
            vec = row.float()
        if params.task == "classify":
            classify.append((len(out), vec))
            out.append([])  # (filled below, once the head has run on every classify row)
            continue
        if params.dimensions is not None:
            vec = vec[: params.dimensions]
        if params.normalize is not False:  # (unset: the default, True)
            vec = torch.nn.functional.normalize(vec, dim=0)
        out.append(vec.cpu().tolist())
    if classify:  # the classifier head on all of them at once: [k, hidden] -> [k, num_labels]
        logits = model.classify(torch.stack([vec for _, vec in classify]))
        activated = model.activate(logits)
        for k, (i, _) in enumerate(classify):
            use_activation = states[i].sampling_params.pooling.activation is not False  # (unset: True)
            out[i] = (activated[k] if use_activation else logits[k]).cpu().tolist()
    return out


def pool_step(step: StepInputs, hidden: torch.Tensor, model: torch.nn.Module) -> None:
    """The model runner's pooling after a step's forward (``hidden`` [T, hidden]): MEAN/CLS requests
    fold in this step's prompt rows (prefill may be chunked); those that reach their prompt's last
    token get their result (``state.pooled``)."""
    accumulate_prompt_rows(step.states, step.common.query_start_loc_cpu, step.seq_lens, hidden)
    if step.pool_rows:
        states = [step.states[r] for r in step.pool_rows]
        for state, result in zip(states, pool(hidden.index_select(0, step.pool_indices.to(hidden.device)), states,
                                              model)):
            state.pooled = result


def collect_pooled(step: StepInputs, pooled: list, prompt_logprobs: list) -> None:
    """Move each pooling request's result (and prompt logprobs, which a generative model's embedding
    request may ask for) from its state to the step's output lists (indexed by batch row). A pooling
    request's result ends it: the scheduler appends no token."""
    for r in step.pool_rows:
        state = step.states[r]
        pooled[r], state.pooled = state.pooled, None
        if state.prompt_logprobs is not None:
            prompt_logprobs[r], state.prompt_logprobs = state.prompt_logprobs, None
