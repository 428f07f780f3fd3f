"""Accepting drafts against what the target model sampled at each draft position.

A request with drafts d_0 .. d_{k-1} feeds ``[last, d_0, .., d_{k-1}]`` and the sampler
draws y_0 .. y_k, where y_j is sampled (with all of the request's sampling parameters) from
the target's distribution p_j given the tokens before it, drafts included::

    accepted = the longest prefix with y_j == d_j;  output = d_0 .. d_{a-1}, y_a

Drafts of a prompt-lookup proposer are deterministic (a one-hot draft distribution q). The
standard speculative-sampling rule accepts d with probability min(1, p(d) / q(d)) = p(d)
and on rejection samples from norm(max(p - q, 0)) = p without d. Drawing y ~ p and
accepting iff y == d does exactly that: P(y == d) = p(d), and a y != d is distributed as p
restricted to the other tokens. So every output token follows the target distribution,
greedy requests get exactly their greedy tokens, and a seeded request draws position j
from the same noise stream as without drafts (seeded by its output count).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class _HasOutputs(Protocol):
    output_token_ids: list[int]


_S = TypeVar("_S", bound=_HasOutputs)  # a request's state (the model runner's CachedRequestState)


def count_accepted(draft_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> int:
    """How many of a step's drafts became output tokens (the scheduler's count): the common
    prefix of the drafts and the tokens the runner returned for the request."""
    num_accepted = 0
    for draft, token in zip(draft_token_ids, output_token_ids):
        if draft != token:
            break
        num_accepted += 1
    return num_accepted


def expand_rows(states: Sequence[_S], drafts: Sequence[list[int]]) -> tuple[list[_S], list[list[int]]]:
    """The model runner's logits rows of a step: one per position that samples, a request's last
    token, then each of its drafts (whose row sees the drafts before it as outputs: penalties,
    min_tokens, seeds). Returns each row's request state and output tokens."""
    row_states = [s for s, d in zip(states, drafts) for _ in range(len(d) + 1)]
    row_outputs = [s.output_token_ids + d[:j] if j else s.output_token_ids
                   for s, d in zip(states, drafts) for j in range(len(d) + 1)]
    return row_states, row_outputs
