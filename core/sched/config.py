"""What the scheduler is built from: limits and switches as one frozen record (``SchedulerConfig``).

The engine derives it from its ``EngineConfig`` once KV-cache sizing and the model are known
(``from_engine_config``); tests build it directly. The scheduler's collaborators (grammar
compiler, draft proposer, KV connector) are live objects, so they are not part of it: they are
the scheduler's keyword arguments.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.kv_cache.spec import KVCacheSpec

SCHEDULING_POLICIES = ("fcfs", "priority")  # (vLLM's --scheduling-policy values)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int  # running requests at most
    max_num_batched_tokens: int  # tokens per step at most (also the step's image-encoding budget)
    max_model_len: int  # prompt + output tokens of one request at most
    block_size: int  # tokens per KV-cache block
    num_blocks: int  # KV-cache blocks, the null block included (from KV-cache sizing)
    enable_prefix_caching: bool = True
    max_loras: int | None = None  # distinct LoRA adapters among running requests; None: LoRA off
    pipeline_parallel: bool = False  # cached requests carry their new output tokens (stages but the last)
    max_concurrent_batches: int = 1  # batches in flight at once (one per pipeline stage)
    enable_chunked_prefill: bool = True  # False: a prompt is prefilled in one step, never split over steps
    async_scheduling: bool = False  # step N+1 is scheduled before step N's output is back (sched/async_steps.py)
    # each attention layer's KV-cache spec (halserve.kv_cache.spec), from the model; (): all full attention
    kv_cache_specs: tuple[KVCacheSpec, ...] = ()
    # "fcfs": arrival order; "priority": by (Request.priority, arrival), preempting lower priorities
    # for a higher one that cannot be admitted (halserve.sched.priority)
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                     "max_concurrent_batches"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill a whole prompt is one step: max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})")
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1 (or None: LoRA off), got {self.max_loras}")

    @classmethod
    def from_engine_config(cls, config: EngineConfig, *, num_blocks: int, max_model_len: int,
                           max_concurrent_batches: int = 1, kv_cache_specs: tuple[KVCacheSpec, ...] = ()
                           ) -> SchedulerConfig:
        """``num_blocks`` comes from KV-cache sizing and ``max_model_len`` from the model
        (``config.max_model_len`` may still be None); ``max_concurrent_batches`` from the executor."""
        return cls(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            block_size=config.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            max_loras=config.max_loras if config.enable_lora else None,
            pipeline_parallel=config.pipeline_parallel_size > 1,
            max_concurrent_batches=max_concurrent_batches,
            enable_chunked_prefill=config.enable_chunked_prefill,
            async_scheduling=config.async_scheduling,
            kv_cache_specs=kv_cache_specs,
            scheduling_policy=config.scheduling_policy,
        )
