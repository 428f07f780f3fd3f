"""The ``uni`` executor: one worker, in the engine's own process.

With async scheduling (``EngineConfig.async_scheduling``) the worker lives on one thread of its
own, which runs every call in the order made: ``submit_model`` returns at once, so the engine
schedules the next step while this one runs (the kernels release the GIL).
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
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
        # async scheduling: the worker's own thread (device selection is per thread: every call runs there)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="halserve-worker") if config.async_scheduling else None

    def _call(self, fn, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs) if self._thread is None else self._thread.submit(fn, *args, **kwargs).result()

    def collective_rpc(self, method: str | Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``Worker.<method>(*args, **kwargs)``; a function ``method`` is called as ``method(worker, ...)``."""
        assert self.worker is not None, "the executor is shut down"
        if callable(method):
            return [self._call(method, self.worker, *args, **kwargs)]
        return [self._call(getattr(self.worker, method), *args, **kwargs)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.worker is not None, "the executor is shut down"
        return self._call(self._execute, scheduler_output)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.worker is not None, "execute_model before initialize"
        output = self.worker.execute_model(scheduler_output)
        assert output is not None, "the only rank is the last pipeline stage: it samples"
        return output

    def submit_model(self, scheduler_output: SchedulerOutput) -> Future | ModelRunnerOutput:
        """Async scheduling: start the step on the worker's thread, after the calls before it."""
        assert self.worker is not None, "the executor is shut down"
        if self._thread is None:
            return self._execute(scheduler_output)
        return self._thread.submit(self._execute, scheduler_output)

    def collect_model(self, handle: Future | ModelRunnerOutput) -> ModelRunnerOutput:
        return handle.result() if isinstance(handle, Future) else handle

    def shutdown(self) -> None:
        if self.worker is not None:
            self._call(self.worker.shutdown)
        self.worker = None
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
