"""EngineCore: the scheduler and the executor, stepping on token ids only.

Not thread-safe: one thread owns it (the caller of LLMEngine, or AsyncLLM's engine
thread). Text (tokenization, detokenization, stop strings) is handled outside it.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from halserve.config import EngineConfig
from halserve.engine.types import EngineCoreRequest, EngineStats

if TYPE_CHECKING:  # pragma: no cover
    from halserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class EngineSleepingError(ValueError):
    """A request arrived while the engine sleeps (``EngineCore.sleep``); ``wake_up`` first. The engine is
    unharmed (the HTTP server answers 503)."""


class EngineCore:
    GRAMMAR_POLL_S = 0.05  # how long a step with nothing to run waits for a grammar (then new requests)

    def __init__(self, config: EngineConfig) -> None:
        from halserve.models.loader import get_model_info, gguf_kv_cache_default, with_kv_cache_dtype
        from halserve.platforms import resolve_platform
        from halserve.plugins import get_plugin_manager
        from halserve.scheduler import Scheduler
        from halserve.structured_output import StructuredOutputManager

        start = time.perf_counter()
        manager = get_plugin_manager()
        self.platform = resolve_platform(config.platform)
        config.platform = self.platform.name
        manager.call_update_config(config, self.platform.name)
        self.platform.check_and_update_config(config)
        self.config = config
        self.model_info = get_model_info(config, self.platform)
        if (kv_default := gguf_kv_cache_default(config, self.model_info, self.platform)) is not None:
            logger.info("KV cache dtype auto -> %s (a GGUF checkpoint computed in float32 keeps llama.cpp's default "
                        "f16 cache; --kv-cache-dtype float32 keeps float32)", kv_default)
            self.model_info = with_kv_cache_dtype(self.model_info, config.kv_cache_dtype, kv_default)
            config.kv_cache_dtype = kv_default
        config.fit_unchunked_prefill(self.model_info.max_model_len)  # (before the workers size their buffers)

        from halserve.kv_connectors import check_kv_transfer

        check_kv_transfer(config)  # (before anything loads: a mistake costs nothing)
        executor_name = config.executor_name
        reg = manager.executors.get(executor_name)
        if reg is None:
            raise ValueError(
                f"executor {executor_name!r} is not available; registered executors: "
                f"{', '.join(manager.executors.names()) or 'none'}"
            )
        if config.async_scheduling:
            from halserve.sched.async_steps import async_refusal

            # With no executor named, the worker gets a process of its own (``mp``): measured on an H200
            # (W2) when ``uni`` ran the worker on a second thread, contending for the GIL: uni 340-420
            # req/s async vs 600-1000 sync; mp 755-780 vs 480-560. ``uni`` now runs deferred steps on
            # this thread (worker/async_output.py); not yet measured on a GPU (run_gpu_checks.sh async).
            named = config.distributed_executor_backend is not None
            async_reg = reg if named else manager.executors.get("mp") or reg
            if (refused := async_refusal(config, self.model_info, async_reg.obj)) is not None:
                logger.warning("async scheduling is off: %s cannot run asynchronously yet; scheduling "
                               "synchronously", refused)
                config.async_scheduling = False
            else:
                if not named and async_reg is not reg:
                    config.distributed_executor_backend = executor_name = async_reg.name
                    reg = async_reg
                logger.info("async scheduling on (executor %s); steps while a request with structured outputs "
                            "runs are synchronous (its grammar needs each token before the next mask)", executor_name)
        self.executor = reg.obj(config, self.platform.name, self.model_info)
        try:
            self.num_blocks = self.executor.initialize()
            kv_connector = self._scheduler_connector()
        except BaseException:
            self.executor.shutdown()
            raise
        # with pipeline stages, one batch per stage in flight (executors that can overlap steps)
        self.max_concurrent_batches = self.executor.max_concurrent_batches
        self._batches: deque = deque()  # (SchedulerOutput, the executor's handle) submitted, not collected
        from halserve.models.kv_cache_specs import model_kv_cache_specs

        self.scheduler = Scheduler.from_engine_config(
            config, num_blocks=self.num_blocks, max_model_len=self.model_info.max_model_len,
            structured_outputs=StructuredOutputManager(self._load_tokenizer, self.model_info.vocab_size),
            max_concurrent_batches=self.max_concurrent_batches, kv_connector=kv_connector,
            kv_cache_specs=model_kv_cache_specs(self.model_info),
        )
        self.lora_registry = None  # with enable_lora: the adapters the workers hold (halserve.lora.registry)
        if config.enable_lora:
            from halserve.lora.registry import LoRARegistry

            self.lora_registry = LoRARegistry(config.resolved_max_cpu_loras, self.executor.collective_rpc,
                                              self._loras_in_use)
        self.num_steps = 0
        self.sleep_level = 0  # 0: awake; 1 or 2 (sleep): requests are refused until wake_up
        logger.info(
            "engine ready in %.1fs: platform %s, %s, %d KV blocks",
            time.perf_counter() - start,
            self.platform.name,
            self.model_info.architecture,
            self.num_blocks,
        )

    def _scheduler_connector(self):
        """The scheduler side of ``kv_transfer_config``'s connector, told about the workers' side; None: off."""
        config = self.config
        if config.kv_transfer_config is None:
            return None
        from halserve.kv_connectors import connector_context, make_connector
        from halserve.kv_connectors.base import Role

        connector = make_connector(config, Role.SCHEDULER, connector_context(config, self.model_info))
        connector.on_workers_ready(self.executor.collective_rpc("kv_connector_info"))
        return connector

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request; raises ValueError if it can never fit in the KV cache."""
        from halserve.request import Request, RequestId

        if self.sleep_level:
            raise EngineSleepingError(f"request {req.request_id!r} arrived while the engine is asleep (sleep level "
                                      f"{self.sleep_level}): call wake_up() (POST /wake_up) first, then send it again")
        if req.lora_request is not None:
            self.add_lora(req.lora_request)
        self.scheduler.add_request(
            Request(
                request_id=RequestId(req.request_id),
                prompt_token_ids=req.prompt_token_ids,
                sampling_params=req.sampling_params,
                eos_token_ids=req.eos_token_ids,
                arrival_time=req.arrival_time,
                max_tokens=req.max_tokens,
                lora_request=req.lora_request,
                mm_features=req.mm_features,
                mrope_positions=req.mrope_positions,
                priority=req.priority,
            )
        )

    # -- LoRA adapters ---------------------------------------------------------------
    def add_lora(self, lora: LoRARequest) -> bool:
        """Have every worker load and validate ``lora`` (once per adapter); ValueError, with the
        engine unharmed, when it cannot be served. True if it was loaded now."""
        if self.lora_registry is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} was requested but LoRA is not enabled; start the "
                             "engine with enable_lora=True (--enable-lora)")
        return self.lora_registry.add(lora)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (the workers drop it once no unfinished request uses it)."""
        return self.lora_registry is not None and self.lora_registry.remove(lora_id)

    def hold_lora(self, lora: LoRARequest, held: bool) -> None:
        """Keep ``lora`` loaded (``held``, loading it first: ValueError if it cannot be served)
        while a caller submits requests with it one after another (a beam search), or let go."""
        if self.lora_registry is None or not held:
            if self.lora_registry is not None:
                self.lora_registry.unpin(lora.lora_int_id)
            return
        self.add_lora(lora)
        self.lora_registry.pin(lora.lora_int_id)

    def list_loras(self) -> set[int]:
        return set() if self.lora_registry is None else self.lora_registry.ids()

    # -- sleep mode and weight updates (the workers' side: halserve.worker.sleep_mode) --
    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep: level 1 drops the KV cache and keeps the weights in host memory, level 2 drops
        both; the memory goes back to the OS (CPU) or the driver (GPU). The prefix cache is reset (its
        K/V is gone). Needs ``enable_sleep_mode`` and no unfinished request; until ``wake_up``, new
        requests are refused with ``EngineSleepingError``. Sleeping again at a deeper level drops more."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is not enabled; start the engine with enable_sleep_mode=True "
                             "(--enable-sleep-mode)")
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (drop the KV cache, keep the weights in host memory) or 2 "
                             f"(drop the weights too), got {level!r}")
        self._check_idle("sleep")
        if level <= self.sleep_level:
            return
        if not self.scheduler.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset though no request runs")  # (a bug)
        self.executor.collective_rpc("sleep", level)
        self.sleep_level = level
        logger.info("engine asleep at level %d", level)

    def wake_up(self) -> None:
        """Take back the weights (level 2: reloaded from the checkpoint, or from the one ``update_weights``
        loaded) and a zeroed KV cache; requests are accepted again. A no-op when awake."""
        if not self.sleep_level:
            return
        self.executor.collective_rpc("wake_up")
        self.sleep_level = 0
        logger.info("engine awake")

    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's); False when some are in use by unfinished requests."""
        return self.scheduler.reset_prefix_cache()

    def update_weights(self, path: str) -> None:
        """Serve the weights of the checkpoint folder ``path`` (the same architecture and sizes) from now on,
        on every worker; allowed asleep or awake with no unfinished request. A mismatch is a ValueError
        that names it, and the old weights keep serving. The prefix cache is reset (its K/V came from the
        old weights)."""
        self._check_idle("update_weights")
        self.executor.collective_rpc("update_weights", path)
        if not self.scheduler.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset though no request runs")  # (a bug)
        logger.info("weights updated from %s", path)

    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict | None = None) -> list:
        """``Worker.<method>(*args, **kwargs)`` on every worker (vLLM's); one result per worker, by rank.
        ``method`` may be a worker method's name or a picklable function called as ``method(worker, ...)``."""
        if not (isinstance(method, str) or callable(method)):
            raise ValueError(f"collective_rpc: method must be a worker method's name or a function, got {method!r}")
        if isinstance(method, str) and method.startswith("_"):
            raise ValueError(f"collective_rpc: {method!r} is private; call a public worker method")
        if isinstance(method, str):
            from halserve.worker.worker import Worker

            if not callable(getattr(Worker, method, None)):
                public = sorted(n for n in dir(Worker) if not n.startswith("_") and callable(getattr(Worker, n)))
                raise ValueError(f"collective_rpc: the worker has no method {method!r}; call one of "
                                 f"{', '.join(public)} (halserve.worker.worker.Worker) or pass a function")
        return self.executor.collective_rpc(method, *tuple(args), **(kwargs or {}))

    def _check_idle(self, what: str) -> None:
        if self.has_unfinished_requests():
            raise ValueError(f"{what}: {len(self.scheduler.requests)} requests are unfinished; wait for them to "
                             "finish (or abort them) first")

    def _loras_in_use(self) -> set[int]:
        return {r.lora_request.lora_int_id for r in self.scheduler.requests.values() if r.lora_request is not None}

    def step(self) -> list:
        """Schedule, run the model once, and return what each request produced."""
        if self.max_concurrent_batches > 1:
            return self._step_overlapped()
        if self.scheduler.async_steps is not None:
            return self._step_async()
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)  # (an empty one drops finished requests)
        if scheduler_output.is_empty:  # every unfinished request waits for its grammar to compile
            self.scheduler.wait_for_grammars(timeout=self.GRAMMAR_POLL_S)
            return []
        return self._finish_step(scheduler_output, runner_output)

    def _step_overlapped(self) -> list:
        """Pipeline stages: keep up to ``max_concurrent_batches`` steps in flight (each of different
        requests: the scheduler skips those in flight), so that stage s works on step t while stage
        s + 1 works on step t - 1. Returns [] while filling the pipeline, then the oldest step's outputs."""
        batches = self._batches
        if len(batches) < self.max_concurrent_batches and self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            if not scheduler_output.is_empty:
                batches.append((scheduler_output, self.executor.submit_model(scheduler_output)))
                if len(batches) < self.max_concurrent_batches:
                    return []  # (the caller steps again: schedule the next batch before waiting)
            elif batches:  # what is left is in flight: wait for it instead
                self.scheduler.unschedule_empty(scheduler_output)
            else:  # nothing in flight, nothing to run: every request waits for its grammar
                self.executor.execute_model(scheduler_output)  # (an empty step drops finished requests)
                self.scheduler.wait_for_grammars(timeout=self.GRAMMAR_POLL_S)
                return []
        if not batches:
            return []
        scheduler_output, handle = batches.popleft()
        return self._finish_step(scheduler_output, self.executor.collect_model(handle))

    def _step_async(self) -> list:
        """Async scheduling: schedule and submit step N+1, then collect step N (one step in flight
        while the engine schedules and processes outputs; halserve.sched.async_steps). Returns []
        right after the first submission. Steps that must see every output first (a request under
        a grammar) wait for the steps in flight and run one at a time."""
        batches, scheduler, async_steps = self._batches, self.scheduler, self.scheduler.async_steps
        assert async_steps is not None, "step() takes this path only with async scheduling on"
        if batches and async_steps.needs_sync_step(scheduler.requests):
            scheduler_output, handle = batches.popleft()
            return self._finish_step(scheduler_output, self.executor.collect_model(handle))
        if scheduler.has_unfinished_requests():
            scheduler_output = scheduler.schedule()
            if not scheduler_output.is_empty:
                batches.append((scheduler_output, self.executor.submit_model(scheduler_output)))
                if len(batches) == 1 and not async_steps.needs_sync_step(scheduler.requests):
                    return []  # (the caller steps again: it schedules the next step before waiting)
            elif batches:  # what is left is in flight (or has all its tokens in flight): wait for it
                scheduler.unschedule_empty(scheduler_output)
            else:  # nothing in flight, nothing to run: every request waits for its grammar
                self.executor.execute_model(scheduler_output)  # (an empty step drops finished requests)
                scheduler.wait_for_grammars(timeout=self.GRAMMAR_POLL_S)
                return []
        if not batches:
            return []
        scheduler_output, handle = batches.popleft()
        return self._finish_step(scheduler_output, self.executor.collect_model(handle))

    def _finish_step(self, scheduler_output, runner_output) -> list:
        self.num_steps += 1
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.lora_registry is not None:
            self.lora_registry.release()
        return outputs

    def _load_tokenizer(self):
        from halserve.engine.llm_engine import load_tokenizer

        return load_tokenizer(self.config, self.model_info)

    def abort_requests(self, request_ids: list[str]) -> None:
        from halserve.request import RequestStatus

        if request_ids:
            self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
            if self.lora_registry is not None:
                self.lora_registry.release()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._batches)

    def get_stats(self) -> EngineStats:
        # The scheduler's snapshot, plus what only the engine knows.
        return EngineStats(**dataclasses.asdict(self.scheduler.get_stats()), num_steps=self.num_steps)

    def shutdown(self) -> None:
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None and scheduler.structured_outputs is not None:
            scheduler.structured_outputs.shutdown()
        if scheduler is not None and scheduler.kv_connector is not None:
            scheduler.kv_connector.shutdown()
        executor, self.executor = getattr(self, "executor", None), None
        if executor is not None:
            executor.shutdown()
