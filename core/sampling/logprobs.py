"""Logprobs of the sampled tokens and their top-k alternatives, from the raw logits."""
from __future__ import annotations

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
