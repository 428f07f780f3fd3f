"""A worker: one rank's device, model and KV cache. Stateful across steps (its model
runner caches each running request), driven by an executor through ``collective_rpc``."""
from __future__ import annotations

import importlib
import logging
import os
from typing import TYPE_CHECKING

from halserve.worker.model_runner import ModelRunner

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.models.loader import ModelInfo
    from halserve.platforms.base import Platform
    from halserve.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        platform_name: str,
        model_info: ModelInfo,
        rank: int = 0,
        world_size: int = 1,
        distributed_init_method: str | None = None,
    ) -> None:
        self.config = config
        self.platform_name = platform_name
        self.model_info = model_info
        self.rank = rank
        self.world_size = world_size
        self.distributed_init_method = distributed_init_method
        self.platform: Platform | None = None
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        """Select this rank's device and join the process group when there are several ranks."""
        from halserve.platforms import resolve_platform

        self.platform = resolve_platform(self.platform_name)
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        if self.platform.device_count() > 1:
            self.platform.set_device(local_rank)
        if self.world_size > 1:
            from halserve.distributed import init_distributed, set_pp_communicator, set_tp_communicator
            from halserve.distributed.communicator import check_communicator

            tp = init_distributed(
                backend=self.platform.dist_backend,
                init_method=self.distributed_init_method,
                rank=self.rank,
                world_size=self.world_size,
                tensor_parallel_size=self.config.tensor_parallel_size,
            )
            if tp.size > 1:  # the platform's ops for the group, and its API 1 fast all-reduce/all-gather
                set_tp_communicator(check_communicator(
                    self.platform.make_device_communicator(tp.group, tp.rank, tp.size), self.platform.name))
                set_tp_communicator(self.platform.make_tp_communicator(tp.group, tp.rank, tp.size))
            if tp.size < self.world_size:  # pipeline stages: their send/recv over the whole world
                set_pp_communicator(check_communicator(
                    self.platform.make_device_communicator(None, self.rank, self.world_size), self.platform.name))
        self.platform.seed_everything(self.config.seed)
        module, _, cls_name = self.platform.model_runner_cls.partition(":")
        runner_cls = getattr(importlib.import_module(module), cls_name)
        self.model_runner = runner_cls(self.config, self.platform, self.model_info)

    def load_model(self) -> None:
        from halserve.worker.sleep_mode import SleepState

        self.model_runner.load_model()
        self.sleep_state = SleepState(self.config, self.model_info)

    def determine_num_kv_blocks(self) -> int:
        return self.model_runner.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def warm_up(self) -> None:
        self.model_runner.warm_up()
        self.model_runner.capture_graphs()

    def shutdown(self) -> None:
        """Release what outlives a step beyond memory (a KV connector's servers)."""
        connector = getattr(self.model_runner, "kv_connector", None)
        if connector is not None:
            connector.shutdown()

    def kv_connector_info(self) -> dict:
        """This rank's ``worker_info`` for the scheduler side of the KV connector ({} without one)."""
        connector = self.model_runner.kv_connector
        return {} if connector is None else connector.worker_info()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's output; None on ranks before the last pipeline stage (they do not sample)."""
        return self.model_runner.execute_model(scheduler_output)

    def execute_model_deferred(self, scheduler_output: SchedulerOutput) -> tuple[bool, ModelRunnerOutput | None]:
        """Async scheduling: launch the step, answer the one before (``ModelRunner.execute_model_deferred``):
        (whether one was pending, its output)."""
        return self.model_runner.execute_model_deferred(scheduler_output)

    def num_placeholder_inputs(self) -> int:
        """How many input tokens were the step before's sampled ids, gathered on the device (async scheduling)."""
        return self.model_runner.num_placeholder_inputs

    def take_deferred_output(self) -> ModelRunnerOutput | None:
        """The last deferred step's output, once its sampled ids are on the host; None when none is pending."""
        return self.model_runner.take_deferred_output()

    # -- lifecycle hooks: sleep mode and weight updates (worker/sleep_mode.py) ------------
    # Called by the engine core through ``collective_rpc`` on every rank, only while no request is
    # unfinished. They free and take back memory through the platform's hooks
    # (``Platform.offload_weights`` / ``restore_weights`` / ``release_memory``).
    def sleep(self, level: int = 1) -> None:
        """Level 1: drop the KV cache, weights to host memory; level 2: drop both. Then release the memory."""
        from halserve.worker import sleep_mode

        sleep_mode.sleep(self.model_runner, self.sleep_state, level)

    def wake_up(self) -> None:
        """Take back what ``sleep`` dropped (level 2: the weights reloaded from their checkpoint)."""
        from halserve.worker import sleep_mode

        sleep_mode.wake_up(self.model_runner, self.sleep_state)

    def update_weights(self, path: str) -> None:
        """Serve the weights of checkpoint folder ``path`` (same architecture); ValueError, old weights kept,
        when it does not match."""
        from halserve.worker import sleep_mode

        sleep_mode.update_weights(self.model_runner, self.sleep_state, path)

    def memory_in_use(self) -> int:
        """Bytes this rank holds on its device (the CPU: its process's RSS); ``Platform.memory_in_use``."""
        return self.platform.memory_in_use()

    # -- LoRA adapters (enable_lora) -------------------------------------------------
    def add_lora(self, lora_request) -> bool:
        """Load and validate an adapter into this rank's cache; ValueError says what is wrong."""
        self._lora_manager().add(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora_manager().remove(lora_id)

    def list_loras(self) -> list[int]:
        return self._lora_manager().list_loras()

    def _lora_manager(self):
        manager = getattr(self.model_runner, "lora_manager", None)
        if manager is None:
            raise ValueError("LoRA is not enabled on this engine; start it with enable_lora=True (--enable-lora)")
        return manager

    def attention_backend_name(self) -> str:
        return self.model_runner.attn_backend_cls.name
