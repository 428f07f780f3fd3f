"""The ``uni`` executor: one worker, in the engine's own process.

With async scheduling (``EngineConfig.async_scheduling``) everything still runs on the engine's
thread, as in vLLM's single-process design: ``submit_model`` launches the step and returns the
step before's output (its sampled ids read back while this step runs on the device;
worker/async_output.py), so the engine processes step N's output and schedules step N + 2 while
the device runs step N + 1. No second thread contends for the Python lock.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from halserve.executors.base import Executor

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.models.loader import ModelInfo
    from halserve.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from halserve.worker.worker import Worker


class UniExecutor(Executor):
    name = "uni"
    supports_multiple_ranks = False
    supports_async_scheduling = True
    description = "a single worker in the engine's process"

    def __init__(self, config: EngineConfig, platform_name: str, model_info: ModelInfo) -> None:
        super().__init__(config, platform_name, model_info)
        from halserve.worker.worker import Worker

        self.worker: Worker | None = Worker(config, platform_name, model_info, rank=0, world_size=1)
        self._defers_steps = config.async_scheduling  # steps go through execute_model_deferred
        self._tickets = itertools.count()
        self._held_step: int | None = None  # the deferred step whose output the worker still holds
        self._finished_steps: dict[int, ModelRunnerOutput] = {}  # ticket -> output, answered but not collected

    def collective_rpc(self, method: str | Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``Worker.<method>(*args, **kwargs)``; a function ``method`` is called as ``method(worker, ...)``."""
        assert self.worker is not None, "the executor is shut down"
        self._take_held()  # (a call between steps sees every step's tokens on the host)
        if callable(method):
            return [method(self.worker, *args, **kwargs)]
        return [getattr(self.worker, method)(*args, **kwargs)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect_model(self.submit_model(scheduler_output))

    def submit_model(self, scheduler_output: SchedulerOutput) -> int | ModelRunnerOutput:
        """Async scheduling: launch the step (a ticket for ``collect_model``), collecting the step before's output."""
        assert self.worker is not None, "the executor is shut down"
        if not self._defers_steps:
            output = self.worker.execute_model(scheduler_output)
            assert output is not None, "the only rank is the last pipeline stage: it samples"
            return output
        had_previous, previous = self.worker.execute_model_deferred(scheduler_output)
        if had_previous:
            assert self._held_step is not None and previous is not None
            self._finished_steps[self._held_step] = previous
        self._held_step = ticket = next(self._tickets)
        return ticket

    def collect_model(self, handle: int | ModelRunnerOutput) -> ModelRunnerOutput:
        if not isinstance(handle, int):
            return handle
        if handle == self._held_step:  # no step came after it: read its ids now
            self._take_held()
        return self._finished_steps.pop(handle)

    def _take_held(self) -> None:
        if self._held_step is not None:
            assert self.worker is not None
            output = self.worker.take_deferred_output()
            assert output is not None, "the worker holds no deferred step"
            self._finished_steps[self._held_step] = output
            self._held_step = None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        self.worker = None
