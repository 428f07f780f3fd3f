"""AMD GPUs through the ROCm (HIP) build of torch."""
from __future__ import annotations

from halserve.platforms.base import ProbeResult
from halserve.platforms.torch_cuda_api import TorchCudaApiPlatform
from halserve.plugins import PluginManifest, hookimpl

# gfx architectures whose fp8 is the "fnuz" flavour (MI300 family); newer ones use OCP e4m3fn.
FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")


class RocmPlatform(TorchCudaApiPlatform):
    name = "rocm"
    device_type = "cuda"  # HIP devices appear as torch "cuda" devices
    dist_backend = "nccl"  # RCCL behind the nccl name
    priority = 90
    supported_dtypes = ("bfloat16", "float16", "float32")
    default_dtype = "bfloat16"
    fp8_dtype = "float8_e4m3fnuz"
    preferred_attention_backends = ("triton_paged_rocm", "triton_paged", "torch")
    description = "AMD GPUs (ROCm build of torch; Triton kernels)"
    graph_mode = "hip_graphs"

    @classmethod
    def _probe(cls) -> ProbeResult:
        import torch

        if torch.version.hip is None:
            return ProbeResult(
                False,
                f"torch {torch.__version__} was built without HIP (torch.version.hip is None); "
                "install a ROCm build of torch (pip install torch --index-url <the ROCm wheel index>) "
                "and then pip install 'halserve[rocm]'",
            )
        if not torch.cuda.is_available():
            return ProbeResult(
                False,
                f"torch {torch.__version__} has HIP {torch.version.hip} but no AMD GPU is visible "
                "(torch.cuda.is_available() is False: check the amdgpu driver and HIP_VISIBLE_DEVICES)",
            )
        return ProbeResult(True, f"{torch.cuda.device_count()} x {cls.gfx_arch()} GPU(s), HIP {torch.version.hip}")

    @staticmethod
    def gfx_arch(index: int = 0) -> str:
        import torch

        return torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]

    def fp8_e4m3_dtype(self) -> str:
        # the class attribute names MI300's flavour; MI350 (gfx950) and later are OCP
        return "float8_e4m3fnuz" if self.gfx_arch() in FNUZ_ARCHS else "float8_e4m3fn"


@hookimpl
def halserve_manifest() -> PluginManifest:
    return PluginManifest(name="rocm", version="0.1.0", api=">=1,<3", description=RocmPlatform.description)


@hookimpl
def halserve_platforms() -> list[type]:
    return [RocmPlatform]


@hookimpl
def halserve_attention_backends() -> list[type]:
    from halserve.attention_backends.triton_paged import RocmTritonPagedAttentionBackend

    return [RocmTritonPagedAttentionBackend]


@hookimpl
def halserve_kernels() -> list[type]:
    # the Triton kernels as "triton_rocm" classes with ROCm's fp8 flavours (e4m3fnuz first)
    from halserve.platforms.triton_kernels import kernels_for

    return kernels_for("rocm")
