"""The model runner's logits rows with drafts (``expand_rows``) and the grammar masks that land on
them (``apply_step_bitmask``): a request with k drafts owns k + 1 rows in a row."""
from dataclasses import dataclass, field

import torch

from halserve.scheduler_output import SchedulerOutput
from halserve.spec_decode.verify import expand_rows
from halserve.structured_output.logits import apply_step_bitmask


@dataclass
class State:
    req_id: str
    output_token_ids: list[int] = field(default_factory=list)


def output(grammar_req_ids, bitmask):
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=[], num_scheduled_tokens={},
                           total_num_scheduled_tokens=0, finished_req_ids=set(), grammar_req_ids=grammar_req_ids,
                           grammar_bitmask=bitmask)


def test_each_draft_row_sees_the_drafts_before_it_as_outputs():
    a, b = State("a", [1]), State("b", [2, 3])
    row_states, row_outputs = expand_rows([a, b], [[], [7, 8]])
    assert [s.req_id for s in row_states] == ["a", "b", "b", "b"]
    assert row_outputs == [[1], [2, 3], [2, 3, 7], [2, 3, 7, 8]]
    assert row_outputs[1] is b.output_token_ids  # (no copy for a request's own row)


def test_grammar_masks_land_on_their_requests_rows():
    a, b, c = State("a"), State("b"), State("c")
    row_states, _ = expand_rows([a, b, c], [[], [5, 6], []])  # rows: a b b b c
    logits = torch.zeros(5, 4)
    bitmask = torch.tensor([[0b0010], [0b0100], [0b1000], [0b0001]], dtype=torch.int32)  # b: 1, 2, 3; c: 0
    masked = apply_step_bitmask(logits, row_states, output(["b", "b", "b", "c"], bitmask))
    allowed = [(row > float("-inf")).nonzero().flatten().tolist() for row in masked]
    assert allowed == [[0, 1, 2, 3], [1], [2], [3], [0]]
    assert apply_step_bitmask(logits, row_states, output([], None)) is logits  # no grammar: untouched
