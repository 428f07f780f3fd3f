"""The model runner's side of structured outputs: the scheduler's token masks applied to a step's
logits rows.

The scheduler sends one mask row per sampled position under a grammar (``grammar_req_ids``: a
request with k drafts appears k + 1 times in a row); the runner's logits have one row per sampled
position of every request (``spec_decode.verify.expand_rows``)::

    logits rows     a  b  b  b  c          (b carries 2 drafts)
    grammar_req_ids    b  b  b  c          -> rows 1, 2, 3, 4
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from halserve.scheduler_output import SchedulerOutput
    from halserve.worker.runner_state import CachedRequestState


def apply_step_bitmask(logits: torch.Tensor, row_states: list[CachedRequestState],
                       scheduler_output: SchedulerOutput) -> torch.Tensor:
    """``logits`` [rows, vocab] with the disallowed tokens of the grammar rows masked out; unchanged
    when the step has no mask."""
    bitmask = scheduler_output.grammar_bitmask
    if bitmask is None:
        return logits
    from halserve.structured_output import apply_grammar_bitmask

    first_row = {s.req_id: j for j, s in reversed(list(enumerate(row_states)))}
    seen: dict[str, int] = {}
    grammar_rows = []
    for req_id in scheduler_output.grammar_req_ids:
        grammar_rows.append(first_row[req_id] + seen.get(req_id, 0))
        seen[req_id] = seen.get(req_id, 0) + 1
    return apply_grammar_bitmask(logits, torch.tensor(grammar_rows, device=logits.device), bitmask)
