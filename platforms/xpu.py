"""Intel GPUs through torch.xpu and Intel Extension for PyTorch (IPEX)."""
from __future__ import annotations

import importlib.util

from halserve.platforms.base import Platform, ProbeResult
from halserve.plugins import PluginManifest, hookimpl


class XpuPlatform(Platform):
    name = "xpu"
    device_type = "xpu"
    # torch >= 2.8 ships the oneCCL backend for XPU as "xccl". Older stacks (IPEX < 2.7
    # with oneccl_bindings_for_pytorch) registered it as "ccl"; see _dist_backend_for().
    dist_backend = "xccl"
    priority = 80
    supported_dtypes = ("bfloat16", "float16", "float32")
    default_dtype = "bfloat16"
    fp8_dtype = None  # IPEX's fp8 KV cache is e5m2 only; no fp8 GEMM
    preferred_attention_backends = ("ipex", "torch")
    description = "Intel GPUs (torch.xpu + intel-extension-for-pytorch kernels)"

    @classmethod
    def _probe(cls) -> ProbeResult:
        import torch

        xpu = getattr(torch, "xpu", None)
        if xpu is None:
            return ProbeResult(False, f"torch {torch.__version__} has no torch.xpu module; install an XPU build of torch")
        if importlib.util.find_spec("intel_extension_for_pytorch") is None:
            return ProbeResult(
                False,
                "intel_extension_for_pytorch is not installed (pip install 'halserve[xpu]' with the XPU build of torch)",
            )
        if not xpu.is_available():
            return ProbeResult(
                False,
                f"torch {torch.__version__} sees no Intel GPU (torch.xpu.is_available() is False)",
            )
        return ProbeResult(True, f"{xpu.device_count()} x {xpu.get_device_name(0)}")

    def __init__(self) -> None:
        import torch

        # The class attribute documents the modern name; an instance on an old stack
        # reports what that stack's torch.distributed actually registers.
        self.dist_backend = _dist_backend_for(torch.__version__)

    def device_count(self) -> int:
        import torch

        return torch.xpu.device_count()

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        import torch

        total = torch.xpu.get_device_properties(index).total_memory
        return total - torch.xpu.memory_reserved(index), total

    def set_device(self, index: int) -> None:
        import torch

        torch.xpu.set_device(index)

    def synchronize(self) -> None:
        import torch

        torch.xpu.synchronize()

    def empty_cache(self) -> None:
        import torch

        torch.xpu.empty_cache()


def _dist_backend_for(torch_version: str) -> str:
    """``xccl`` from torch 2.8 on (built into torch); ``ccl`` (oneccl_bindings_for_pytorch) before."""
    from packaging.version import Version

    return "xccl" if Version(Version(torch_version).base_version) >= Version("2.8") else "ccl"


@hookimpl
def halserve_manifest() -> PluginManifest:
    return PluginManifest(name="xpu", version="0.1.0", api=">=1,<3", description=XpuPlatform.description)


@hookimpl
def halserve_platforms() -> list[type]:
    return [XpuPlatform]


@hookimpl
def halserve_attention_backends() -> list[type]:
    # The module imports no IPEX; the backend imports it inside its calls.
    from halserve.attention_backends.ipex import IpexAttentionBackend

    return [IpexAttentionBackend]


@hookimpl
def halserve_kernels() -> list[type]:
    # Classes only: IPEX is imported when a layer's weight is prepared.
    from halserve.platforms.xpu_kernels import IpexAwqGemm, IpexGptqGemm

    return [IpexAwqGemm, IpexGptqGemm]
