"""Records that cross between the engine's processors and its core."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from halserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from halserve.lora.request import LoRARequest
    from halserve.multimodal.processing import MRopePositions, MultiModalFeature


@dataclass(slots=True)
class EngineCoreRequest:
    """A validated, tokenized request for the core (one per sample when n > 1)."""

    request_id: str  # the core's id (a child id "<i>_<parent>" when n > 1)
    parent_id: str  # the user's request id
    index: int  # which of the parent's n samples
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: set[int]  # model eos ids; empty when ignore_eos
    max_tokens: int  # resolved: params.max_tokens or up to max_model_len
    arrival_time: float
    lora_request: LoRARequest | None = None  # its LoRA adapter; None: the base model
    mm_features: list[MultiModalFeature] | None = None  # its images (halserve.multimodal); None: none
    mrope_positions: MRopePositions | None = None  # an M-RoPE model's prompt positions with images
    priority: int = 0  # lower runs first under --scheduling-policy priority; fcfs takes only 0


@dataclass(slots=True)
class EngineStats:
    """A snapshot for metrics; counters are cumulative since start."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable blocks in use
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    num_preemptions: int = 0
    kv_connector_hit_tokens: int = 0  # prompt tokens a KV connector loaded instead of computing
    spec_num_drafts: int = 0  # speculative decoding: decode steps that carried drafts
    spec_num_draft_tokens: int = 0  # draft tokens checked
    spec_num_accepted_tokens: int = 0  # of which accepted
    num_steps: int = 0
    extra: dict = field(default_factory=dict)
    kv_cache_group_usage: tuple[float, ...] = ()  # per KV-cache group (SchedulerStats' field of that name)
    # (the SchedulerStats fields of these names)
    kv_cache_group_kinds: tuple[str, ...] = ()
    iteration_tokens_counts: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_loras: int = 0
