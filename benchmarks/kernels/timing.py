"""Shared by the kernel benchmarks: device choice (GPU, or the Triton interpreter on CPU) and timing."""
from __future__ import annotations

import os
import time
from typing import Callable


def setup_device() -> str:
    """'cuda' when a GPU is visible; else 'cpu' with TRITON_INTERPRET=1 (set before any kernel import)."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return "cpu"


def time_ms(fn: Callable[[], object], device: str, iters: int, warmup: int = 3) -> float:
    """Median milliseconds per call (CUDA events on a GPU, wall clock elsewhere)."""
    import torch

    for _ in range(warmup if device == "cuda" else 1):
        fn()
    samples = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]
