"""The executor protocol: how the engine drives its workers, whatever their number.

    engine ──execute_model(SchedulerOutput)──▶ executor ──▶ worker rank 0 .. N-1
           ◀──────────── ModelRunnerOutput ───────────── (the last pipeline stage's first rank)

Ranks are laid out stage-major: rank = pipeline stage * tensor_parallel_size + tensor rank.
Only the last stage samples; the other stages' workers answer ``execute_model`` with None.

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


class WorkerDiedError(RuntimeError):
    """A worker exited, or the executor is unusable because one did (or a call failed) earlier."""


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback as the ``__cause__`` of the error re-raised in the engine."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class Executor:
    """Base class of executors. Subclasses implement the methods marked (subclasses)."""

    name: ClassVar[str]
    """What ``--distributed-executor-backend`` takes."""
    supports_multiple_ranks: ClassVar[bool] = False
    supports_async_scheduling: ClassVar[bool] = False
    """(optional) default False: with ``config.async_scheduling``, ``submit_model`` returns before the
    step has run and the ranks fill in the sampled tokens of the step before (halserve.sched.async_steps);
    False: the engine warns and schedules synchronously."""
    description: ClassVar[str] = ""

    def __init__(self, config: EngineConfig, platform_name: str, model_info: ModelInfo) -> None:
        if config.world_size > 1 and not self.supports_multiple_ranks:
            raise ValueError(
                f"executor {self.name!r} runs a single rank but tensor_parallel_size="
                f"{config.tensor_parallel_size} x pipeline_parallel_size={config.pipeline_parallel_size} "
                "needs several; use an executor that supports several ranks "
                "(--distributed-executor-backend mp or ray) or a size of 1"
            )
        self.config = config
        self.platform_name = platform_name
        self.model_info = model_info

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def output_rank(self) -> int:
        """The rank whose ``execute_model`` answer the engine gets: the last stage's first rank."""
        return self.config.world_size - self.config.tensor_parallel_size

    def sampling_ranks(self) -> range:
        """The ranks that sample (the last pipeline stage); they must all sample the same tokens."""
        return range(self.output_rank, self.config.world_size)

    def pick_output(self, results: list[Any]) -> ModelRunnerOutput:
        """The engine's answer from every rank's ``execute_model`` result (by rank; a rank other
        than ``output_rank`` may have answered with only its sampled token ids). Raises when two
        sampling ranks disagree: their request states diverged, and later steps would be garbage."""
        output = results[self.output_rank]
        for rank in self.sampling_ranks():
            if rank == self.output_rank:
                continue
            tokens = results[rank]
            tokens = getattr(tokens, "sampled_token_ids", tokens)
            if tokens != output.sampled_token_ids:
                raise RuntimeError(f"rank {rank} sampled {tokens} but rank {self.output_rank} sampled "
                                   f"{output.sampled_token_ids}; the ranks' request states diverged")
        return output

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

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; return the output rank's answer (``pick_output``)."""
        return self.pick_output(self.collective_rpc("execute_model", scheduler_output))

    # -- overlapped steps (pipeline parallelism) ---------------------------------------
    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine may have in flight at once: with several pipeline stages, an executor
        that implements ``submit_model``/``collect_model`` lets each stage work on its own batch.
        1 (the default): one step at a time."""
        return 1

    def submit_model(self, scheduler_output: SchedulerOutput) -> Any:
        """(subclasses, with ``max_concurrent_batches`` > 1) Start a step on every rank without waiting;
        returns a handle for ``collect_model``. Steps run on each rank in the order submitted."""
        return self.execute_model(scheduler_output)

    def collect_model(self, handle: Any) -> ModelRunnerOutput:
        """(subclasses) The output of the step ``submit_model`` started (waiting for it); handles are
        collected in the order they were submitted."""
        return handle

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """(subclasses) Call ``Worker.<method>(*args, **kwargs)`` on every rank; results by rank. ``method``
        may also be a (picklable, module-level) function, called as ``method(worker, *args, **kwargs)``."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if a worker died (optional) default: no-op for in-process workers."""

    def shutdown(self) -> None:
        """Stop the workers and free their resources (optional) default: no-op. Idempotent."""
