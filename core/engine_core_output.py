"""What the scheduler reports to the engine per request after each step."""
from __future__ import annotations

from dataclasses import dataclass

from halserve.outputs import FinishReason
from halserve.scheduler_output import SampleLogprobs


@dataclass(slots=True)
class EngineCoreOutput:
    """Emitted by ``Scheduler.update_from_output`` for each request that got new tokens or
    finished this step (a mid-prefill chunk emits nothing). Aborts requested through
    ``finish_requests`` emit nothing: the caller already knows."""

    request_id: str
    new_token_ids: list[int]  # sampled this step, in order (0 or 1 today); the eos/stop token is included
    new_logprobs: list[SampleLogprobs] | None  # one per new token when the request asked for logprobs
    finish_reason: FinishReason | None = None  # "stop" | "length" | "abort"; None while it runs on
    stop_reason: int | str | None = None  # the stop token id, or why no token could be sampled; None for eos / length
    num_cached_tokens: int = 0  # prefix-cache hit (tokens) found when first scheduled
    prompt_logprobs: list[SampleLogprobs] | None = None  # prompt tokens 1.. (prompt_logprobs), with the first token
    pooled: list[float] | None = None  # a pooling request's result (embedding or class probs), as it ends
    scheduled_time: float | None = None  # time.time() it was first scheduled: on its first output only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
