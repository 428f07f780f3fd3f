"""The ``example`` platform: our "device" is the host CPU, driven through torch."""
from __future__ import annotations

import os

from halserve.platforms.base import Platform, ProbeResult


class ExamplePlatform(Platform):
    name = "example"
    device_type = "cpu"  # a real accelerator names its torch device type here ("cuda", "xpu", ...)
    dist_backend = "gloo"  # ... and its collective library ("nccl", "xccl", ...)
    priority = -5  # below cpu (0): chosen only with --platform example or HALSERVE_PLATFORM=example
    supported_dtypes = ("float32", "bfloat16")
    default_dtype = "float32"
    fp8_dtype = None  # no fp8 arithmetic on this device
    preferred_attention_backends = ("example_attn", "torch")
    description = "example device (the host CPU through torch)"

    @classmethod
    def _probe(cls) -> ProbeResult:
        # Cheap and honest: say why it is (not) available. A real device checks its driver here.
        import torch

        threads = torch.get_num_threads()
        if threads < 1:
            return ProbeResult(False, "torch reports no CPU threads (torch.get_num_threads() < 1)")
        return ProbeResult(True, f"host CPU with {os.cpu_count()} cores, torch {torch.__version__} using {threads} threads")

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total

    def kv_cache_budget(self, fraction: float) -> int:
        free, _total = self.memory_info()
        return int(min(free * fraction * 0.5, 1 << 30))  # host memory is shared: at most 1 GiB

    def make_device_communicator(self, group, rank: int, size: int):
        # (plugin API 2) this device's collectives and send/recv for one group of ranks
        from halserve_plugin_example.communicator import ExampleCommunicator

        return ExampleCommunicator(group, rank, size)
