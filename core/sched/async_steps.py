"""Async scheduling (``EngineConfig.async_scheduling``): the scheduler's side of running step N+1
while step N is still on the worker.

The scheduler schedules step N+1 before it has seen step N's output, so it cannot know the
tokens step N samples. Each such token is a *placeholder* (``Request.num_output_placeholders``)::

    after schedule(N):  num_computed += scheduled tokens    (not in update_from_output)
                        a request reaching the end of its known tokens + placeholders samples
                        in step N: placeholders += 1
    schedule(N+1):      a sampling request gets 1 more token, whose input is step N's placeholder;
                        the worker (steps in order) gathers its real id on the device from step
                        N's sampled ids, by request id (worker/async_output.py)
    update(N):          placeholders -= 1, the sampled token is appended and stops are checked

A request that finishes in step N (stop token, max_tokens, a stop string, an abort) is found one
step late: its token from step N+1 is dropped (its id is gone from ``requests``). A request is
never given a placeholder past ``max_tokens`` or ``max_model_len``. A request preempted while its
step N ran still gets step N's token (its blocks were freed after the worker wrote them, and
the worker runs steps in order); it resumes with it, as without async scheduling.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.models.loader import ModelInfo
    from halserve.request import Request
    from halserve.scheduler_output import SchedulerOutput


def async_refusal(config: EngineConfig, model_info: ModelInfo, executor_cls: type) -> str | None:
    """The feature (in words) that keeps ``config`` from scheduling asynchronously; None: none.
    The engine calls it at start-up and, when it names one, warns and runs synchronously."""
    if not getattr(executor_cls, "supports_async_scheduling", False):
        return f"the {config.executor_name!r} executor"
    checks = (
        (config.speculative_config is not None, "speculative decoding (speculative_config)"),
        (config.pipeline_parallel_size > 1, "pipeline parallelism (pipeline_parallel_size > 1)"),
        (config.kv_transfer_config is not None, "a KV connector (kv_transfer_config / kv_offloading_size)"),
        (config.enable_lora, "LoRA adapters (enable_lora)"),
        (model_info.runner == "pooling", "a pooling model (embed, classify)"),
        (model_info.is_multimodal, "a vision-language model"),
    )
    return next((name for refused, name in checks if refused), None)


class AsyncSteps:
    """Placeholders and the batches in flight (oldest first), for the scheduler."""

    def __init__(self) -> None:
        # per batch in flight: req_id -> (the request, whether it samples in that batch)
        self.batches: deque[dict[str, tuple[Request, bool]]] = deque()

    @staticmethod
    def num_pending_tokens(request: Request) -> int:
        """Tokens of a running request not computed or scheduled yet (placeholders count as known)."""
        return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens

    @staticmethod
    def can_schedule(request: Request, max_model_len: int) -> bool:
        """Whether a running request may take one more step: not when its tokens in flight already
        reach ``max_tokens`` or ``max_model_len`` (it ends when they come back)."""
        placeholders = request.num_output_placeholders
        return (request.num_output_tokens + placeholders < request.max_tokens
                and request.num_tokens + placeholders < max_model_len)

    @staticmethod
    def needs_sync_step(requests: dict) -> bool:
        """Whether the next step must see every earlier step's output first: a request under a
        grammar (structured outputs) needs its matcher advanced before its next token mask."""
        return any(r.grammar is not None or r.grammar_future is not None for r in requests.values())

    def scheduled(self, output: SchedulerOutput, requests: dict) -> None:
        """After ``schedule()``: advance the scheduled requests and count what they will sample. An
        empty step is not a batch (it never comes back through ``update_from_output``)."""
        if output.is_empty:
            return
        batch: dict[str, tuple[Request, bool]] = {}
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = requests[req_id]
            request.num_computed_tokens += num_tokens
            samples = request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders
            if samples:
                request.num_output_placeholders += 1
            batch[req_id] = (request, samples)
        self.batches.append(batch)

    def returned(self) -> dict[str, tuple[Request, bool]]:
        """The oldest batch in flight, as its output comes back (``update_from_output``)."""
        return self.batches.popleft()

    @staticmethod
    def preempted(request: Request) -> None:
        request.num_output_placeholders = 0  # (its steps in flight still return their tokens)
