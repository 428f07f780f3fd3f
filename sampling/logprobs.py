"""Logprobs of the sampled tokens and their top-k alternatives, from the raw logits; and of
given tokens (a prompt's) from the hidden states before them."""
from __future__ import annotations

from collections.abc import Callable

import torch

from halserve.scheduler_output import SampleLogprobs


def gather_logprobs(
    raw_logprobs: torch.Tensor,  # [R, V] f32: log_softmax of the model's logits
    sampled: torch.Tensor,  # [R] int64
    num_logprobs: list[int | None],  # per row: top alternatives asked, None = no logprobs
    max_num_logprobs: int,
) -> list[SampleLogprobs | None]:
    """One ``SampleLogprobs`` per row that asked (None elsewhere); one host transfer in all."""
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    if len(rows) < len(num_logprobs):
        index = torch.tensor(rows, dtype=torch.int64, device=raw_logprobs.device)
        raw_logprobs = raw_logprobs.index_select(0, index)  # [L, V]
        sampled = sampled.index_select(0, index)  # [L]
    token_logprob = raw_logprobs.gather(1, sampled.unsqueeze(1))  # [L, 1]
    # 1-based rank: tokens strictly more likely, plus one (ties share the best rank).
    rank = (raw_logprobs > token_logprob).sum(dim=-1) + 1  # [L]
    num_top = min(max_num_logprobs, raw_logprobs.shape[1])
    if num_top > 0:
        top_logprobs, top_ids = raw_logprobs.topk(num_top, dim=-1)  # [L, K]
        top_logprobs_list, top_ids_list = top_logprobs.tolist(), top_ids.tolist()
    else:
        top_logprobs_list = top_ids_list = [[] for _ in rows]

    out: list[SampleLogprobs | None] = [None] * len(num_logprobs)
    for j, (row, tid, lp, r) in enumerate(zip(rows, sampled.tolist(), token_logprob.squeeze(1).tolist(), rank.tolist())):
        k = num_logprobs[row]
        out[row] = SampleLogprobs(
            token_id=tid,
            logprob=lp,
            rank=r,
            top_token_ids=top_ids_list[j][:k],
            top_logprobs=top_logprobs_list[j][:k],
        )
    return out


# Rows of logits computed at once when scoring many tokens: a 2,048-token prompt chunk of a
# 128k vocabulary would be 1 GB of float32 logits in one piece.
SCORE_ROWS = 256


def score_tokens(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,  # [T, H] the step's hidden states
    indices: list[int],  # [P] rows of ``hidden`` whose logits score a token
    targets: list[int],  # [P] the token each of them scores
    num_logprobs: list[int],  # [P] top alternatives asked per row
) -> list[SampleLogprobs]:
    """``SampleLogprobs`` of each target token under the logits of the row before it (prompt
    logprobs), ``SCORE_ROWS`` rows of logits at a time."""
    out: list = []
    for lo in range(0, len(indices), SCORE_ROWS):
        hi = lo + SCORE_ROWS
        index = torch.tensor(indices[lo:hi], dtype=torch.long, device=hidden.device)
        logprobs = compute_logits(hidden.index_select(0, index)).float().log_softmax(dim=-1)
        tokens = torch.tensor(targets[lo:hi], dtype=torch.long, device=logprobs.device)
        out.extend(gather_logprobs(logprobs, tokens, num_logprobs[lo:hi], max(num_logprobs[lo:hi])))
    return out
