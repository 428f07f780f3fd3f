"""The model runner's per-request state between steps and the flattened inputs of one step
(``model_runner``)."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from halserve.attention_backends.base import AttentionMetadata

if TYPE_CHECKING:  # pragma: no cover
    from halserve.lora.request import LoRARequest
    from halserve.multimodal.processing import MRopePositions, MultiModalFeature
    from halserve.sampling_params import SamplingParams
    from halserve.scheduler_output import SchedulerOutput
    from halserve.worker.pooler import PromptPool

logger = logging.getLogger("halserve.worker.model_runner")


@dataclass(slots=True)
class StepInputs:
    """One step's flattened inputs, on the host; the runner moves them to the device."""

    req_ids: list[str]  # batch order
    states: list[CachedRequestState]
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    common: AttentionMetadata  # host tensors
    seq_lens: np.ndarray  # [R] context length after this step
    sample_rows: list[int]  # requests that sample a token this step
    logits_indices: torch.Tensor  # [L] their last token in the batch (and their drafts': see sample_drafts)
    # speculative decoding: per sample row its draft tokens (k of them: k + 1 logits rows, the
    # positions of its last token and drafts); None when no request has drafts (L = len(sample_rows))
    sample_drafts: list[list[int]] | None = None
    # pooling requests (embed, classify) that reach their prompt's end this step: they end with
    # their pooled result and sample no token
    pool_rows: list[int] = dataclasses.field(default_factory=list)
    pool_indices: torch.Tensor | None = None  # [len(pool_rows)] their last token in the batch
    # prompt_logprobs: rows of the batch whose logits score the prompt token after them
    prompt_indices: list[int] = dataclasses.field(default_factory=list)  # [P] token index in the batch
    prompt_targets: list[int] = dataclasses.field(default_factory=list)  # [P] the prompt token it scores
    prompt_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (request row, count), in order
    # a hybrid model: KV-cache groups 1..'s metadata (``common`` is group 0's): their own block_table
    # and slot_mapping, the rest shared; None: one group
    group_common: list[AttentionMetadata] | None = None
    # async scheduling: tokens whose id the step before is still sampling (the runner's host state does
    # not have it yet); the runner fills them on the device from that step's sampled ids, by request id
    placeholder_indices: list[int] = dataclasses.field(default_factory=list)  # [P] token index in the batch
    placeholder_req_ids: list[str] = dataclasses.field(default_factory=list)  # [P] whose token it is


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # prompt_logprobs asked and the prompt not yet all scored: entries for prompt tokens 1.. so far
    prompt_logprobs: list | None = None
    pooled: list[float] | None = None  # a pooling request's result (embedding or class probs), until sent
    prompt_pool: PromptPool | None = None  # a MEAN/CLS embedding request's prompt rows pooled so far
    lora_request: LoRARequest | None = None  # its LoRA adapter; None: the base model
    mm_features: list[MultiModalFeature] | None = None  # its images; None: none
    mrope_positions: MRopePositions | None = None  # an M-RoPE model's prompt positions with images
    # its images' embeddings computed and not yet all fed to the model: feature index -> [length, H]
    mm_embeddings: dict[int, torch.Tensor] | None = None
    # a hybrid model: KV-cache groups 1..'s block tables (block_ids is group 0's); None: one group
    group_block_ids: list[list[int]] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]


def update_states(requests: dict[str, CachedRequestState], out: SchedulerOutput, receives_tokens: bool) -> None:
    """Apply a step's diffs to the runner's request states: drop finished (and preempted) requests,
    add new (and resumed) ones, extend the others. ``receives_tokens``: a pipeline stage before the
    last, which learns the sampled tokens from the scheduler (the last stage sampled them itself)."""
    for req_id in out.finished_req_ids:
        requests.pop(req_id, None)
    for new in out.scheduled_new_reqs:
        requests[new.req_id] = CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=new.prompt_token_ids,
            output_token_ids=list(new.output_token_ids),
            sampling_params=new.sampling_params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            # (a request resumed after its first token has sent its prompt logprobs already)
            prompt_logprobs=[] if new.sampling_params.prompt_logprobs is not None and not new.output_token_ids
            else None,
            lora_request=new.lora_request,
            mm_features=new.mm_features,
            mrope_positions=new.mrope_positions,
            group_block_ids=None if new.group_block_ids is None else [list(ids) for ids in new.group_block_ids],
        )
    for cached in out.scheduled_cached_reqs:
        state = requests[cached.req_id]
        state.block_ids.extend(cached.new_block_ids)
        if cached.new_group_block_ids is not None:
            for table, ids in zip(state.group_block_ids, cached.new_group_block_ids):
                table.extend(ids)
        state.num_computed_tokens = cached.num_computed_tokens
        if receives_tokens:
            state.output_token_ids.extend(cached.new_token_ids)
