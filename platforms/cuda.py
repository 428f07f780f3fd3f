"""NVIDIA GPUs through the CUDA build of torch."""
from __future__ import annotations

from typing import Any

from halserve.platforms.base import ProbeResult
from halserve.platforms.torch_cuda_api import TorchCudaApiPlatform
from halserve.plugins import PluginManifest, hookimpl


class CudaPlatform(TorchCudaApiPlatform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    priority = 100
    supported_dtypes = ("bfloat16", "float16", "float32")
    default_dtype = "bfloat16"
    fp8_dtype = "float8_e4m3fn"
    preferred_attention_backends = ("flash_attn", "triton_paged", "torch")
    description = "NVIDIA GPUs (CUDA build of torch; Triton and flash-attn kernels)"
    graph_mode = "cuda_graphs"

    @classmethod
    def _probe(cls) -> ProbeResult:
        import torch

        if torch.version.cuda is None:
            hip = f" (it is a ROCm build: torch.version.hip={torch.version.hip})" if torch.version.hip else ""
            return ProbeResult(
                False,
                f"torch {torch.__version__} was built without CUDA (torch.version.cuda is None){hip}; "
                "install a CUDA build of torch, e.g. pip install 'halserve[cuda]' on a machine with an NVIDIA driver",
            )
        if not torch.cuda.is_available():
            return ProbeResult(
                False,
                f"torch {torch.__version__} has CUDA {torch.version.cuda} but torch.cuda.is_available() is False "
                "(no NVIDIA GPU visible: check the driver and CUDA_VISIBLE_DEVICES)",
            )
        n = torch.cuda.device_count()
        major, minor = torch.cuda.get_device_capability(0)
        return ProbeResult(
            True, f"{n} x {torch.cuda.get_device_name(0)} (sm_{major}{minor}), CUDA {torch.version.cuda}"
        )

    def capability(self, index: int = 0) -> tuple[int, int]:
        import torch

        return torch.cuda.get_device_capability(index)

    def supports_fp8(self) -> bool:
        return self.capability() >= (8, 9)  # Ada and Hopper have fp8 tensor cores

    def check_and_update_config(self, config: Any) -> None:
        super().check_and_update_config(config)


@hookimpl
def halserve_manifest() -> PluginManifest:
    return PluginManifest(name="cuda", version="0.1.0", api=">=1,<3", description=CudaPlatform.description)


@hookimpl
def halserve_platforms() -> list[type]:
    return [CudaPlatform]


@hookimpl
def halserve_attention_backends() -> list[type]:
    # classes only: flash_attn and triton are imported when a backend is instantiated
    from halserve.attention_backends.flash_attn import FlashAttnBackend
    from halserve.attention_backends.triton_paged import TritonPagedAttentionBackend

    return [FlashAttnBackend, TritonPagedAttentionBackend]


@hookimpl
def halserve_kernels() -> list[type]:
    from halserve.platforms.triton_kernels import kernels_for
    from halserve.platforms.triton_kernels.fp8_gemm import CudaScaledMmFp8Gemm

    return [CudaScaledMmFp8Gemm, *kernels_for("cuda")]
