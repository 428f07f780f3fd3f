"""The ``uni`` executor: one worker, in the engine's own process."""
from __future__ import annotations

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
    description = "a single worker in the engine's process"

    def __init__(self, config: EngineConfig, platform_name: str, model_info: ModelInfo) -> None:
        super().__init__(config, platform_name, model_info)
        from halserve.worker.worker import Worker

        self.worker: Worker | None = Worker(config, platform_name, model_info, rank=0, world_size=1)

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        assert self.worker is not None, "the executor is shut down"
        return [getattr(self.worker, method)(*args, **kwargs)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.worker is not None, "the executor is shut down"
        output = self.worker.execute_model(scheduler_output)
        assert output is not None, "the only rank is the last pipeline stage: it samples"
        return output

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        self.worker = None
