"""The shape of a scheduler feature rule (``AdmissionPolicy``) and its verdict (``Admission``).

The scheduler holds a short list of the rules its features need (``Scheduler.policies``; a
feature that is off has none) and calls these hooks::

    add_request       on_added(request)        refuse (ValueError) or prepare a new request
    schedule, step 2  begin_step(running)      once per step, before the waiting queue is read
                      check(request)           per waiting request, in FCFS order, until one says STOP
                      on_admitted(request)     it got its blocks and runs from this step
    a request ends    on_finished(request)     finished or aborted (not preempted)

Only rules whose ``gates_admission`` is true are asked ``check``/``begin_step``/``on_admitted``
(a rule that only validates requests costs the step nothing).
"""
from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from halserve.request import Request


class Admission(enum.Enum):
    ADMIT = enum.auto()  # nothing against it: it runs if budget and blocks allow
    SKIP = enum.auto()  # not this step: look at the next waiting request (it keeps its place)
    STOP = enum.auto()  # not this step, and nobody behind it either


class AdmissionPolicy:
    """A feature's admission and bookkeeping rule. Every hook is optional; default: no-op / ADMIT."""

    gates_admission: bool = True  # whether schedule() asks it about waiting requests

    def on_added(self, request: Request) -> None:
        """(optional) ``add_request``, before the request is queued: raise ValueError (quoting the
        request id and saying how to fix it) to refuse it. default: accept."""

    def begin_step(self, running: Iterable[Request]) -> None:
        """(optional) Once per ``schedule()``, before admission; ``running``: the running requests
        after step 1 (preemptions done). default: nothing."""

    def check(self, request: Request) -> Admission:
        """(optional) Whether the waiting ``request`` may be admitted this step. default: ADMIT."""
        return Admission.ADMIT

    def on_admitted(self, request: Request) -> None:
        """(optional) ``request`` was admitted (it got its blocks). default: nothing."""

    def on_finished(self, request: Request) -> None:
        """(optional) ``request`` finished or was aborted; forget it. default: nothing."""


class UnservedFeatures(AdmissionPolicy):
    """Refuses requests asking for a feature this engine was built without (no grammar compiler;
    LoRA off). Validation only: it never gates a step."""

    gates_admission = False

    def __init__(self, *, has_structured_outputs: bool, has_lora: bool) -> None:
        self.has_structured_outputs = has_structured_outputs
        self.has_lora = has_lora

    def on_added(self, request: Request) -> None:
        req_id = request.request_id
        if not self.has_structured_outputs and getattr(request.sampling_params, "structured_outputs", None) is not None:
            raise ValueError(f"request {req_id!r} asks for structured outputs, which this engine does not serve")
        if not self.has_lora and request.lora_request is not None:
            raise ValueError(f"request {req_id!r} asks for LoRA adapter {request.lora_request.lora_name!r} but LoRA "
                             "is not enabled; start the engine with enable_lora=True (--enable-lora)")
