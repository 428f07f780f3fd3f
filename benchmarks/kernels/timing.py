"""Shared by the kernel benchmarks: device choice (GPU, or the Triton interpreter on CPU) and timing."""
from __future__ import annotations

import os
import time
from collections.abc import Callable


def setup_device() -> str:
    """'cuda' when a GPU is visible; else 'cpu' with TRITON_INTERPRET=1 (set before any kernel import)."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return "cpu"


def time_ms(fn: Callable[[], object], device: str, iters: int, warmup: int = 3, rounds: int = 5) -> float:
    """Milliseconds per call: the median over ``rounds`` of the mean of ``iters`` calls.

    On a GPU the calls of a round are queued back to back between two CUDA events, so the
    figure is device time: Python's launch overhead (tens of microseconds per Triton launch)
    overlaps the previous call's kernels instead of counting as idle GPU time, which would
    understate the bandwidth of a sub-millisecond kernel. Elsewhere: wall clock per call.
    """
    import torch

    for _ in range(warmup if device == "cuda" else 1):
        fn()
    samples = []
    for _ in range(rounds if device == "cuda" else 1):
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / iters)
    samples.sort()
    return samples[len(samples) // 2]
