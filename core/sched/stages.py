"""The scheduler's pipeline-stage rules (``pipeline_parallel``, ``max_concurrent_batches``).

With pipeline parallelism the stages before the last never see sampled tokens, so a cached
request carries its new output tokens (``CachedRequestData.new_token_ids``). With more than one
batch in flight (one per stage), a scheduled request is "in flight" until its batch's output
comes back: later batches skip it and never preempt it, and each batch takes at most its share
of the running requests, so that the stages work on different batches at the same time.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from halserve.sched.base import Admission, AdmissionPolicy

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Iterable

    from halserve.request import Request
    from halserve.scheduler_output import CachedRequestData


class PipelineStages(AdmissionPolicy):
    """Asked about waiting requests only with batches in flight (``overlapping``): an aborted
    request's id, reused before its batch came back, waits for that batch."""

    def __init__(self, pipeline_parallel: bool, max_concurrent_batches: int) -> None:
        self.carries_tokens = pipeline_parallel
        self.max_concurrent_batches = max_concurrent_batches
        self.overlapping = max_concurrent_batches > 1
        self.gates_admission = self.overlapping
        self.in_flight: dict[str, Request] = {}  # req_id -> the request its unreturned batch computes

    def share(self, num_running: int) -> int:
        """Running requests one batch may take: all of them, or its share with batches in flight."""
        return -(-num_running // self.max_concurrent_batches)

    def check(self, request: Request) -> Admission:
        return Admission.SKIP if request.request_id in self.in_flight else Admission.ADMIT

    @staticmethod
    def send_new_tokens(cached: CachedRequestData, request: Request) -> None:
        """The output tokens the stages have not been sent yet ride along with ``cached``."""
        cached.new_token_ids = request.output_token_ids[request.num_output_tokens_sent:]
        request.num_output_tokens_sent = request.num_output_tokens

    def launched(self, req_ids: Iterable[str], requests: dict) -> None:
        """A batch with these requests goes out (with batches in flight: they are in flight now)."""
        if self.overlapping:
            self.in_flight.update((req_id, requests[req_id]) for req_id in req_ids)
