"""The CPU platform: always available, the reference every other platform is checked against."""
from __future__ import annotations

import os

from halserve.platforms.base import Platform, ProbeResult
from halserve.plugins import PluginManifest, hookimpl


def _num_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = 0  # the fallback: every accelerator outranks it
    supported_dtypes = ("float32", "bfloat16", "float16")
    default_dtype = "float32"
    fp8_dtype = None
    preferred_attention_backends = ("cpu_native", "torch")
    description = "CPU through torch (uses all cores by default)"

    @classmethod
    def _probe(cls) -> ProbeResult:
        return ProbeResult(True, f"{_num_cores()} CPU cores available")

    def __init__(self) -> None:
        import torch

        # All cores by default; HALSERVE_CPU_THREADS overrides (e.g. one rank per socket).
        threads = int(os.environ.get("HALSERVE_CPU_THREADS", _num_cores()))
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def device_count(self) -> int:
        return 1

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total

    def kv_cache_budget(self, fraction: float) -> int:
        # Host memory is shared with everything else on the machine: like vLLM's
        # VLLM_CPU_KVCACHE_SPACE default, take at most 4 GiB unless told otherwise.
        free, _total = self.memory_info()
        return int(min(free * fraction * 0.5, 4 << 30))


@hookimpl
def halserve_manifest() -> PluginManifest:
    return PluginManifest(name="cpu", version="0.1.0", api=">=1,<2", description=CpuPlatform.description)


@hookimpl
def halserve_platforms() -> list[type]:
    return [CpuPlatform]


@hookimpl
def halserve_attention_backends() -> list[type]:
    from halserve.attention_backends.cpu_native import CpuNativeAttentionBackend

    return [CpuNativeAttentionBackend]


@hookimpl
def halserve_kernels() -> list[type]:
    from halserve.platforms.cpu_kernels.fused import CpuFusedRmsNorm, CpuFusedRotaryEmbedding
    from halserve.platforms.cpu_kernels.onednn_gemm import OneDnnGemm

    return [OneDnnGemm, CpuFusedRmsNorm, CpuFusedRotaryEmbedding]
