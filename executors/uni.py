"""The ``uni`` executor: one worker, in the engine's own process."""
from __future__ import annotations

from typing import Any

from halserve.executors.base import Executor


class UniExecutor(Executor):
    name = "uni"
    supports_multiple_ranks = False
    description = "a single worker in the engine's process"

    def __init__(self, config, platform_name, model_info) -> None:
        super().__init__(config, platform_name, model_info)
        from halserve.worker.worker import Worker

        self.worker = Worker(config, platform_name, model_info, rank=0, world_size=1)

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args, **kwargs)]

    def execute_model(self, scheduler_output):
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        self.worker = None
