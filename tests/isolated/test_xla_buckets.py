"""The XLA bucketing helper (default suite: plain torch, no torch-xla needed)."""
from __future__ import annotations

import pytest
import torch

from halserve.attention_backends.base import AttentionMetadata
from halserve.worker.xla_buckets import (
    bucket_for,
    max_num_graphs,
    pad_step,
    request_buckets,
    token_buckets,
)


def test_buckets_are_powers_of_two_up_to_the_limit():
    assert token_buckets(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(10) == [10]
    assert request_buckets(256) == [8, 16, 32, 64, 128, 256]
    assert request_buckets(5) == [5]
    assert max_num_graphs(100, 20) == 4 * 3


def test_bucket_for_picks_the_smallest_fit_and_rejects_overflow():
    b = token_buckets(100)
    assert [bucket_for(n, b) for n in (1, 16, 17, 64, 65, 100)] == [16, 16, 32, 64, 100, 100]
    with pytest.raises(ValueError, match="exceeds the largest bucket 100"):
        bucket_for(101, b)


def _common(query_lens, seq_lens, block_size=4):
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    nb = max(-(-s // block_size) for s in seq_lens)
    bt = torch.arange(1, 1 + len(seq_lens) * nb, dtype=torch.int32).view(len(seq_lens), nb)
    slots = []
    for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(s - q, s):
            slots.append(int(bt[r, pos // block_size]) * block_size + pos % block_size)
    return AttentionMetadata(
        num_actual_tokens=sum(query_lens), num_reqs=len(query_lens), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=qsl.clone(), seq_lens=seq.clone(), block_table=bt,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl, seq_lens_cpu=seq,
    )


def test_pad_step_pads_every_tensor_and_keeps_real_counts():
    common = _common([3, 1, 1], [7, 9, 2])
    ids = torch.tensor([5, 6, 7, 8, 9])
    pos = torch.tensor([4, 5, 6, 8, 1])
    step = pad_step(common, ids, pos, max_num_batched_tokens=64, max_num_seqs=32, max_blocks_per_req=6)
    md = step.metadata
    assert (step.num_tokens, step.num_reqs, step.num_tokens_padded, step.num_reqs_padded) == (5, 3, 16, 8)
    assert md.num_actual_tokens == 5 and md.num_reqs == 3
    assert step.input_ids.tolist() == [5, 6, 7, 8, 9] + [0] * 11
    assert step.positions.tolist() == [4, 5, 6, 8, 1] + [0] * 11
    assert md.slot_mapping.tolist() == common.slot_mapping.tolist() + [0] * 11
    assert md.query_start_loc.tolist() == [0, 3, 4, 5, 5, 5, 5, 5, 5]
    assert md.seq_lens.tolist() == [7, 9, 2, 0, 0, 0, 0, 0]
    assert md.block_table.shape == (8, 6) and md.block_table.dtype == torch.int32
    assert torch.equal(md.block_table[:3, :3], common.block_table)
    assert md.block_table[3:].abs().sum() == 0 and md.block_table[:, 3:].abs().sum() == 0
    assert step.logits_indices.tolist() == [2, 3, 4, 0, 0, 0, 0, 0]
    assert torch.equal(md.query_start_loc_cpu, md.query_start_loc)


def test_padded_shapes_depend_only_on_buckets():
    """Steps of different sizes in one bucket produce identical shapes (one XLA graph)."""
    shapes = set()
    for qls in ([1], [2, 1], [5, 5, 5], [16]):
        common = _common(qls, [q + 3 for q in qls])
        n = sum(qls)
        step = pad_step(common, torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                        max_num_batched_tokens=64, max_num_seqs=8, max_blocks_per_req=8)
        md = step.metadata
        shapes.add((tuple(step.input_ids.shape), tuple(md.query_start_loc.shape), tuple(md.seq_lens.shape),
                    tuple(md.block_table.shape), tuple(md.slot_mapping.shape), tuple(step.logits_indices.shape)))
    assert shapes == {((16,), (9,), (8,), (8, 8), (16,), (8,))}


def test_pad_step_rejects_inconsistent_inputs():
    common = _common([2], [2])
    with pytest.raises(ValueError, match="num_actual_tokens=2"):
        pad_step(common, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long),
                 max_num_batched_tokens=16, max_num_seqs=8, max_blocks_per_req=4)
    with pytest.raises(ValueError, match="max_blocks_per_req=0"):
        pad_step(common, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                 max_num_batched_tokens=16, max_num_seqs=8, max_blocks_per_req=0)
