"""Static shapes for XLA: pad each step's inputs to a small set of bucket sizes.

XLA compiles one graph per distinct set of input shapes. A step's shapes depend on the
number of scheduled tokens T and requests R, which change every step; padding them to
buckets bounds the number of graphs::

    token buckets    16, 32, 64, ... , max_num_batched_tokens   (powers of two, then the max)
    request buckets   8, 16, 32, ... , max_num_seqs
    graphs <= len(token buckets) * len(request buckets)   (per distinct step kind)

A padded step (T=5 real tokens in bucket 16, R=2 real requests in bucket 8)::

    input_ids / positions   [16]     real 5, then 0
    slot_mapping            [16]     real 5, then padding_slot (a slot of the null block 0,
                                     which pads block tables and is never read unmasked)
    query_start_loc         [8 + 1]  real 3 entries, then the last one repeated (empty requests)
    seq_lens                [8]      real 2, then 0
    block_table             [8, max_blocks_per_req]   fixed width, padded with block 0
    logits_indices          [8]      last token of each real request, then 0

``num_actual_tokens`` and ``num_reqs`` keep the real counts; an XLA backend must take its
shapes from the tensors, never from those ints (or from ``max_query_len``/``max_seq_len``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from halserve.attention_backends.base import AttentionMetadata

MIN_TOKEN_BUCKET = 16
MIN_REQUEST_BUCKET = 8


def power_of_two_buckets(minimum: int, maximum: int) -> list[int]:
    """``minimum, 2*minimum, ...`` below ``maximum``, then ``maximum`` itself."""
    if minimum < 1 or maximum < 1:
        raise ValueError(f"bucket bounds must be >= 1, got minimum={minimum}, maximum={maximum}")
    buckets = []
    b = minimum
    while b < maximum:
        buckets.append(b)
        b *= 2
    buckets.append(maximum)
    return buckets


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    return power_of_two_buckets(MIN_TOKEN_BUCKET, max_num_batched_tokens)


def request_buckets(max_num_seqs: int) -> list[int]:
    return power_of_two_buckets(MIN_REQUEST_BUCKET, max_num_seqs)


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket >= n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}; raise the limit the buckets were built from")


def max_num_graphs(max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Upper bound on the distinct (tokens, requests) shapes a bucketed runner produces."""
    return len(token_buckets(max_num_batched_tokens)) * len(request_buckets(max_num_seqs))


@dataclass
class PaddedStep:
    """One step's model inputs padded to buckets (all tensors on the host)."""

    input_ids: torch.Tensor  # [T_pad] int64
    positions: torch.Tensor  # [T_pad] int64
    metadata: AttentionMetadata  # every tensor padded; the ints keep the real counts
    logits_indices: torch.Tensor  # [R_pad] int64, last token of each real request, then 0
    num_tokens: int  # T (real)
    num_reqs: int  # R (real)
    num_tokens_padded: int  # T_pad
    num_reqs_padded: int  # R_pad


def _pad1(t: torch.Tensor, n: int, value) -> torch.Tensor:
    out = torch.full((n,), value, dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


def pad_step(
    common: AttentionMetadata,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_blocks_per_req: int,
    padding_slot: int = 0,
) -> PaddedStep:
    """Pad a step (host tensors, as the model runner builds them) to its buckets.

    ``padding_slot`` receives the K/V of padded tokens; the default 0 is slot 0 of the
    null block 0, which only pads block tables and is always masked when read.
    """
    num_tokens, num_reqs = common.num_actual_tokens, common.num_reqs
    if input_ids.shape[0] != num_tokens or positions.shape[0] != num_tokens:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must have "
            f"num_actual_tokens={num_tokens} entries"
        )
    if common.block_table.shape[1] > max_blocks_per_req:
        raise ValueError(
            f"block_table has {common.block_table.shape[1]} columns, more than max_blocks_per_req={max_blocks_per_req}"
        )
    t_pad = bucket_for(num_tokens, token_buckets(max_num_batched_tokens))
    r_pad = bucket_for(num_reqs, request_buckets(max_num_seqs))

    qsl = common.query_start_loc_cpu.to(torch.int32)
    qsl_pad = _pad1(qsl, r_pad + 1, int(qsl[num_reqs]))
    seq_pad = _pad1(common.seq_lens_cpu.to(torch.int32), r_pad, 0)
    bt = torch.zeros(r_pad, max_blocks_per_req, dtype=torch.int32)
    bt[:num_reqs, : common.block_table.shape[1]] = common.block_table.cpu()
    slots = _pad1(common.slot_mapping.cpu()[:num_tokens].to(torch.int64), t_pad, padding_slot)
    logits_indices = torch.zeros(r_pad, dtype=torch.int64)
    logits_indices[:num_reqs] = qsl[1 : num_reqs + 1].to(torch.int64) - 1
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=num_reqs,
        max_query_len=common.max_query_len,
        max_seq_len=common.max_seq_len,
        query_start_loc=qsl_pad,
        seq_lens=seq_pad,
        block_table=bt,
        slot_mapping=slots,
        query_start_loc_cpu=qsl_pad.clone(),
        seq_lens_cpu=seq_pad.clone(),
    )
    return PaddedStep(
        input_ids=_pad1(input_ids.cpu().to(torch.int64), t_pad, 0),
        positions=_pad1(positions.cpu().to(torch.int64), t_pad, 0),
        metadata=metadata,
        logits_indices=logits_indices,
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        num_tokens_padded=t_pad,
        num_reqs_padded=r_pad,
    )


def metadata_to_device(md: AttentionMetadata, device) -> AttentionMetadata:
    """Move a (padded) step's device tensors to ``device`` in one go; host copies stay."""
    return AttentionMetadata(
        num_actual_tokens=md.num_actual_tokens,
        num_reqs=md.num_reqs,
        max_query_len=md.max_query_len,
        max_seq_len=md.max_seq_len,
        query_start_loc=md.query_start_loc.to(device),
        seq_lens=md.seq_lens.to(device),
        block_table=md.block_table.to(device),
        slot_mapping=md.slot_mapping.to(device),
        query_start_loc_cpu=md.query_start_loc_cpu,
        seq_lens_cpu=md.seq_lens_cpu,
    )
