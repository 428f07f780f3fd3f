"""The executor protocol: how the engine drives its workers, whatever their number.

    engine ──execute_model(SchedulerOutput)──▶ executor ──▶ worker rank 0 .. N-1
           ◀──────────── ModelRunnerOutput ───────────── (rank 0's answer)

An executor starts the workers (in-process, one process per rank, or Ray actors), lets
them load the model, measures how much memory is left for the KV cache, allocates it,
and then runs one step per call. Executors are plugins (``halserve_executors``); the
``uni`` executor runs a single worker in the engine's own process.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.models.loader import ModelInfo
    from halserve.scheduler_output import ModelRunnerOutput, SchedulerOutput


class Executor:
    """Base class of executors. Subclasses implement the methods marked (subclasses)."""

    name: ClassVar[str]
    """What ``--distributed-executor-backend`` takes."""
    supports_multiple_ranks: ClassVar[bool] = False
    description: ClassVar[str] = ""

    def __init__(self, config: "EngineConfig", platform_name: str, model_info: "ModelInfo") -> None:
        if config.tensor_parallel_size > 1 and not self.supports_multiple_ranks:
            raise ValueError(
                f"executor {self.name!r} runs a single rank but tensor_parallel_size="
                f"{config.tensor_parallel_size}; use an executor that supports several ranks "
                "(--distributed-executor-backend mp) or tensor_parallel_size=1"
            )
        self.config = config
        self.platform_name = platform_name
        self.model_info = model_info

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"supports_multiple_ranks": cls.supports_multiple_ranks, "description": cls.description}

    # -- lifecycle -------------------------------------------------------------------
    def initialize(self) -> int:
        """Start the workers, load the model, size and allocate the KV cache, warm up.

        Returns the number of KV blocks every rank allocated (the scheduler's pool size).
        Ranks may have different free memory; the smallest block count wins.
        """
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
        else:
            num_blocks = min(self.collective_rpc("determine_num_kv_blocks"))
        self.collective_rpc("initialize_kv_cache", num_blocks)
        self.collective_rpc("warm_up")
        return num_blocks

    def execute_model(self, scheduler_output: "SchedulerOutput") -> "ModelRunnerOutput":
        """Run one step on every rank; return rank 0's output."""
        return self.collective_rpc("execute_model", scheduler_output)[0]

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """(subclasses) Call ``Worker.<method>(*args, **kwargs)`` on every rank; results by rank."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if a worker died (optional) default: no-op for in-process workers."""

    def shutdown(self) -> None:
        """Stop the workers and free their resources (optional) default: no-op. Idempotent."""
