"""The scheduler's LoRA rule: at most ``max_loras`` distinct adapters among running requests.

A waiting request whose adapter would be one too many is passed over, and later requests
whose adapters already run may go ahead of it. To bound its wait, once it has been
overtaken ``max_overtakes`` times nobody behind it is admitted any more: the running
requests drain, an adapter slot frees, and it runs (no starvation).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from halserve.sched.base import Admission, AdmissionPolicy

if TYPE_CHECKING:  # pragma: no cover
    from halserve.request import Request


class LoRAAdmission(AdmissionPolicy):
    """``check``: ADMIT when its adapter runs already or a slot is free; SKIP when no slot is free;
    STOP when no slot is free and it has been overtaken ``max_overtakes`` times."""

    def __init__(self, max_loras: int, max_overtakes: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self.max_overtakes = max_overtakes
        self._active: set[int] = set()  # adapters of running requests (this step)
        self._first_blocked: str | None = None  # the earliest request passed over this step
        self._num_overtaken: dict[str, int] = {}  # request id -> admissions that went ahead of it

    def begin_step(self, running: Iterable[Request]) -> None:
        self._active = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
        self._first_blocked = None

    def check(self, request: Request) -> Admission:
        lora = request.lora_request
        if lora is None or lora.lora_int_id in self._active or len(self._active) < self.max_loras:
            return Admission.ADMIT
        if self._num_overtaken.get(request.request_id, 0) >= self.max_overtakes:
            return Admission.STOP
        if self._first_blocked is None:
            self._first_blocked = request.request_id
        return Admission.SKIP

    def on_admitted(self, request: Request) -> None:
        if request.lora_request is not None:
            self._active.add(request.lora_request.lora_int_id)
        self._num_overtaken.pop(request.request_id, None)
        if self._first_blocked is not None:
            self._num_overtaken[self._first_blocked] = self._num_overtaken.get(self._first_blocked, 0) + 1

    def on_finished(self, request: Request) -> None:
        self._num_overtaken.pop(request.request_id, None)


__all__ = ["Admission", "LoRAAdmission"]
