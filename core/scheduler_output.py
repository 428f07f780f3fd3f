"""What crosses between the scheduler and the executor, each way, once per step.

The worker is stateful: it caches each running request's token ids and block table, so
the scheduler sends a full record only for requests the worker has not seen (new, or
resumed after preemption) and small diffs for the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from halserve.kv_cache.block import BlockId
    from halserve.kv_connectors.base import KVConnectorMetadata
    from halserve.lora.request import LoRARequest
    from halserve.multimodal.processing import MRopePositions, MultiModalFeature
    from halserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker has not seen, or one resumed after preemption (the worker
    dropped it then: preemption is announced through ``finished_req_ids``)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated before a preemption (recomputed now); [] when new
    sampling_params: SamplingParams
    block_ids: list[BlockId]  # the request's whole block table so far
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hit), before this step
    lora_request: LoRARequest | None = None  # its LoRA adapter; None: the base model
    mm_features: list[MultiModalFeature] | None = None  # its images; None: none
    mrope_positions: MRopePositions | None = None  # an M-RoPE model's prompt positions with images
    # a hybrid model (several KV-cache groups, halserve.kv_cache.spec): groups 1..'s whole tables
    # (block_ids is group 0's); None: one group
    group_block_ids: list[list[BlockId]] | None = None


@dataclass
class CachedRequestData:
    """A request the worker already holds, scheduled again this step."""

    req_id: str
    new_block_ids: list[BlockId]  # blocks appended to its table since the last step (often [])
    num_computed_tokens: int  # tokens in the KV cache before this step
    # pipeline parallelism only: its output tokens sampled since the workers last heard of it (the
    # stages before the last do not sample); [] otherwise
    new_token_ids: list[int] = field(default_factory=list)
    # a hybrid model: groups 1..'s blocks appended since the last step (new_block_ids is group 0's); None: one group
    new_group_block_ids: list[list[BlockId]] | None = None


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step (>= 1)
    total_num_scheduled_tokens: int  # sum of num_scheduled_tokens
    finished_req_ids: set[str] = field(default_factory=set)  # finished, aborted or preempted since the last step: drop state
    num_preempted: int = 0  # preemptions made while building this step (metrics)
    # structured outputs: the requests that sample this step under a grammar, and their
    # allowed next tokens, one row each (bit t of a row: token t allowed), [k, ceil(vocab / 32)] int32
    grammar_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: torch.Tensor | None = None
    # speculative decoding: req_id -> draft tokens fed after its last token this step (counted
    # in num_scheduled_tokens: 1 + len(drafts)); the runner samples at every one of those positions
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # a KV connector's loads and saves for this step (halserve.kv_connectors.base.KVConnectorMetadata); None: none
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class SampleLogprobs:
    """Logprobs of one sampled token: its own and the top-k alternatives (k = request's logprobs)."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token in the distribution
    top_token_ids: list[int]  # best first
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # the requests scheduled this step, in the runner's batch order
    # per request: [token] when it sampled, [] mid-prefill (partial chunk); with drafts, the
    # accepted drafts then the token sampled after them (1 .. len(drafts) + 1 tokens)
    sampled_token_ids: list[list[int]]
    # per request, when its sampling params asked for logprobs: one entry per sampled token
    logprobs: list[list[SampleLogprobs] | None]
    # per request: with its first sampled token, the logprobs of prompt tokens 1.. when it
    # asked for prompt_logprobs (None otherwise; [] = no request asked this step)
    prompt_logprobs: list[list[SampleLogprobs] | None] = field(default_factory=list)
    # per request: a pooling request's result (an embedding, or class probabilities), which ends it
    # with no token (it never samples); None otherwise
    pooled: list[list[float] | None] = field(default_factory=list)
    # requests whose constraints (a grammar, allowed_token_ids) left no token to sample:
    # they sampled nothing ([] above) and end here, finish_reason "stop" (the scheduler says why)
    no_token_req_ids: set[str] = field(default_factory=set)
    # requests that sampled a stop token before min_tokens because the other constraints
    # allowed nothing else (a complete structured output): it ends them as after min_tokens
    min_tokens_waived: set[str] = field(default_factory=set)
    # draft-model speculative decoding: per request (batch order), the drafts its draft model proposes
    # for its next step ([] none); empty list when no draft model runs
    spec_token_ids: list[list[int]] = field(default_factory=list)
    # a KV connector's blocks that could not be loaded this step (their K/V is garbage): the scheduler
    # recomputes the requests holding them
    invalid_block_ids: set[int] = field(default_factory=set)
