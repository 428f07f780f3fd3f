"""The scheduler's structured-outputs rule: a request waits (keeping its place) until its grammar
has compiled, and each step's requests that sample under a grammar get their token masks."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from halserve.sched.base import Admission, AdmissionPolicy

if TYPE_CHECKING:  # pragma: no cover
    from halserve.request import Request
    from halserve.scheduler_output import SchedulerOutput
    from halserve.structured_output import StructuredOutputManager


class GrammarGate(AdmissionPolicy):
    def __init__(self, manager: StructuredOutputManager) -> None:
        self.manager = manager

    def on_added(self, request: Request) -> None:
        if getattr(request.sampling_params, "structured_outputs", None) is not None:
            self.manager.submit(request)

    def check(self, request: Request) -> Admission:
        return Admission.ADMIT if self.manager.is_ready(request) else Admission.SKIP

    def on_finished(self, request: Request) -> None:
        self.manager.cancel(request)  # (aborted while its grammar compiled)

    def wait(self, waiting: Iterable[Request], timeout: float) -> None:
        """Block until a waiting request's grammar compiles, at most ``timeout`` seconds."""
        self.manager.wait(waiting, timeout)

    def fill_bitmask(self, output: SchedulerOutput, requests: dict[Any, Request]) -> None:
        """Set ``output``'s mask fields for the requests that sample this step under a grammar: one
        mask row per sampled position (with k drafts, k + 1 rows in a row, the req_id repeated)."""
        spec_tokens = output.scheduled_spec_decode_tokens
        req_ids: list[str] = []
        grammars, drafts = [], []
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = requests[req_id]
            grammar = request.grammar
            if grammar is not None and grammar.masks and request.num_computed_tokens + num_tokens >= request.num_tokens:
                drafts.append(spec_tokens.get(req_id, []))
                req_ids.extend([req_id] * (len(drafts[-1]) + 1))
                grammars.append(grammar)
        if grammars:
            output.grammar_req_ids = req_ids
            output.grammar_bitmask = self.manager.grammar_bitmask(grammars, drafts)
