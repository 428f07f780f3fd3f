"""One generation request as the scheduler sees it (per-request state of the engine core).

The engine builds a ``Request`` from the user's prompt and ``SamplingParams`` and hands
it to ``Scheduler.add_request``; from then on only the scheduler mutates it.

Token bookkeeping (T = num_tokens = prompt + outputs so far)::

    all_token_ids:  p0 p1 ... p(P-1) o0 o1 ... o(k-1)
                    |<--- num_computed_tokens --->|      K/V already in the cache
                                                  |<->| still to feed the model

A decoding request always has exactly one token to feed (the last sampled one, whose
K/V is not in the cache yet); a prefilling request has the rest of its prompt.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType

from halserve.kv_cache.hashing import BlockHash

if TYPE_CHECKING:  # pragma: no cover
    from concurrent.futures import Future

    from halserve.lora.request import LoRARequest
    from halserve.multimodal.processing import MRopePositions, MultiModalFeature
    from halserve.outputs import FinishReason
    from halserve.sampling_params import SamplingParams
    from halserve.structured_output import RequestGrammar

RequestId = NewType("RequestId", str)


class RequestStatus(enum.IntEnum):
    """Life cycle: WAITING -> RUNNING (-> PREEMPTED -> RUNNING ...) -> FINISHED_*."""

    WAITING = enum.auto()  # queued, never scheduled yet
    RUNNING = enum.auto()  # holds KV blocks, in the running batch
    PREEMPTED = enum.auto()  # lost its blocks (recompute), back at the front of waiting
    FINISHED_STOPPED = enum.auto()  # eos, a stop token id, or a stop string (upstream)
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()  # the client went away / abort_request

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True)
class Request:
    request_id: RequestId
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    """Resolved output budget (the engine turns ``None`` into ``max_model_len - prompt_len``)."""
    eos_token_ids: set[int] = field(default_factory=set)
    """The model's eos ids; the engine passes an empty set when ``ignore_eos``."""
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    """Under the ``priority`` scheduling policy: lower runs first (and is preempted last); ties go by
    arrival. The ``fcfs`` policy takes only 0 (``Scheduler.add_request`` refuses others)."""
    output_token_ids: list[int] = field(default_factory=list)
    """Generated so far. Append through ``append_output_token_id`` (keeps ``all_token_ids`` in step)."""
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose K/V is in the cache (prefix-cache hits included)."""
    num_cached_tokens: int | None = None
    """Prefix-cache hit (tokens) found when first scheduled; None until then. Reported to the user."""
    first_scheduled_time: float | None = None
    """``time.time()`` when the scheduler first admitted it (kept across preemption); None until then.
    Reported once, with its first output (the queue and prefill times of metrics and traces)."""
    block_hashes: list[BlockHash] = field(default_factory=list)
    """Chained hashes of the request's full blocks, in order; extended as tokens arrive."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended it, or why its constraints left no token to
    generate (``ModelRunnerOutput.no_token_req_ids``); None for eos, length or abort."""
    num_preemptions: int = 0
    grammar_future: Future | None = None
    """Structured outputs: its grammar compiling in the background; None once compiled (or never
    asked). The scheduler admits the request only then."""
    grammar: RequestGrammar | None = None
    """Structured outputs: its matcher, from when it is first scheduled (kept across preemption)."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter it runs with; None: the base model."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft-model speculation: the drafts the workers proposed for its next step ([] none)."""
    mm_features: list[MultiModalFeature] | None = None
    """Its images (placeholder runs in the prompt, pixel values, content hashes); None: none."""
    mrope_positions: MRopePositions | None = None
    """An M-RoPE model's (Qwen2-VL) positions of its prompt with images; None: plain positions."""
    kv_load_failed: bool = False
    """A KV connector's blocks for it failed to load once: it is recomputed without the connector."""
    num_output_tokens_sent: int = 0
    """Pipeline parallelism: its output tokens the workers were sent so far (stages before the last
    do not sample, so the scheduler sends them the new ones)."""
    num_output_placeholders: int = 0
    """Async scheduling: tokens sampled in steps still in flight (their ids are not known here yet;
    the worker has them). Always 0 without async scheduling."""
    _all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def all_token_ids(self) -> list[int]:
        """prompt + outputs. Read-only view by convention (do not mutate)."""
        return self._all_token_ids

    @property
    def block_hash_extra_keys(self):
        """What besides token ids tells its K/V apart in the prefix cache: its adapter, and for a
        block its images overlap, their content hashes (a function of the block's token span then)."""
        lora_key = None if self.lora_request is None else self.lora_request.block_hash_key
        if not self.mm_features:
            return lora_key
        from halserve.multimodal.processing import overlapping_identifiers

        features = self.mm_features

        def keys(start: int, end: int):
            images = overlapping_identifiers(features, start, end)
            return (lora_key, ("image", *images)) if images else lora_key

        return keys

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        """OpenAI's finish_reason: "stop" | "length" | "abort", None while unfinished."""
        return _FINISH_REASONS.get(self.status)

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int, waive_min_tokens: bool = False) -> bool:
        """After appending one token (the scheduler): whether it ends the request, setting
        ``status`` (and ``stop_reason``). Order: min_tokens holds off eos and stop ids (not
        length) unless waived (the runner sampled the stop token because the request's
        constraints allowed nothing else); then eos (kept in the output), stop_token_ids
        (stop_reason = the id), then max_tokens / max_model_len. A stop token that is also
        the last allowed token reports "stop" (vLLM would say "length")."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if waive_min_tokens or self.num_output_tokens >= (getattr(params, "min_tokens", 0) or 0):
            if not getattr(params, "ignore_eos", False) and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in (getattr(params, "stop_token_ids", None) or ()):
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False


__all__ = ["Request", "RequestId", "RequestStatus"]
