"""The worker-lifecycle hooks of ``Platform`` that sleep mode uses (halserve.worker.sleep_mode):
the default weight offload round trip, and the CPU's release of freed memory to the OS."""
from __future__ import annotations

import gc

import psutil
import torch

from halserve.platforms.base import Platform
from halserve.platforms.cpu import CpuPlatform


def test_default_offload_and_restore_keep_every_weight():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    model.register_buffer("scale", torch.arange(4.0))
    model[1].weight = model[0].bias  # (a tied weight moves once)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    platform = CpuPlatform()
    Platform.offload_weights(platform, model)  # (the base class's default: to host memory, pinned when it can)
    Platform.restore_weights(platform, model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    assert model[1].weight is model[0].bias


def test_cpu_release_memory_returns_freed_tensors_to_the_os():
    platform = CpuPlatform()  # (applies its malloc tuning: freed memory stays in the heap without the trim)
    size = 64 << 20
    data = torch.ones(size // 4)  # touched: resident
    gc.collect()
    held = psutil.Process().memory_info().rss
    del data
    platform.release_memory()
    released = held - psutil.Process().memory_info().rss
    assert released >= size * 0.9, f"RSS fell by {released >> 20} MiB after freeing {size >> 20} MiB"
