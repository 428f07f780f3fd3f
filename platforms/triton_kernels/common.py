"""What every Triton kernel class shares: the triton check, GEMM tile choice, platform variants."""
from __future__ import annotations

import importlib.util
import os
from typing import Any, ClassVar

from halserve.kernels.base import Kernel

FLOATS = ("float16", "bfloat16", "float32")


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (CPU tests): kernels run in numpy, one program at a time."""
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonKernel(Kernel):
    """Base of the Triton kernels: declared for cuda and rocm, registered per platform."""

    name = "triton"
    platforms = ("cuda", "rocm")
    priority = 10  # above the torch references (0)
    platform_overrides: ClassVar[dict[str, dict[str, Any]]] = {}
    """Class attributes that differ per platform, e.g. the fp8 dtypes: {"rocm": {"dtypes": (...)}}."""

    @classmethod
    def _supports(cls, **problem: Any) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install 'halserve[cuda]' or 'halserve[rocm]')"
        return cls._supports_problem(**problem)

    @classmethod
    def _supports_problem(cls, **problem: Any) -> str | None:
        """(optional) default: None. Shape checks of the op."""
        return None


def kernels_for(platform: str) -> list[type[Kernel]]:
    """The Triton kernel classes ``platform`` registers: one subclass per op named
    ``triton_<platform>``, running only there, with that platform's overrides applied."""
    from halserve.platforms.triton_kernels.activation import TritonGeluTanhAndMul, TritonSiluAndMul
    from halserve.platforms.triton_kernels.fp8_block_gemm import BLOCK_FP8_KERNELS
    from halserve.platforms.triton_kernels.fp8_gemm import TritonFp8ScaledGemm
    from halserve.platforms.triton_kernels.fused_moe import TritonFusedMoe
    from halserve.platforms.triton_kernels.gguf import TritonGgufGemm
    from halserve.platforms.triton_kernels.int8_gemm import TritonInt8ScaledGemm
    from halserve.platforms.triton_kernels.quant import TritonScaledFp8Quant, TritonScaledInt8Quant
    from halserve.platforms.triton_kernels.rms_norm import TritonRmsNorm
    from halserve.platforms.triton_kernels.rotary import TritonRotaryEmbedding
    from halserve.platforms.triton_kernels.wo4_gemm import TritonAwqGemm, TritonGptqGemm

    bases = [
        TritonFp8ScaledGemm, TritonInt8ScaledGemm, TritonScaledFp8Quant, TritonScaledInt8Quant,
        TritonAwqGemm, TritonGptqGemm, TritonRmsNorm, TritonRotaryEmbedding, TritonSiluAndMul, TritonGeluTanhAndMul,
        TritonFusedMoe, TritonGgufGemm, *BLOCK_FP8_KERNELS,
    ]
    return [for_platform(cls, platform) for cls in bases]


def for_platform(cls: type[TritonKernel], platform: str) -> type[TritonKernel]:
    attrs = {"name": f"triton_{platform}", "platforms": (platform,), **cls.platform_overrides.get(platform, {})}
    attrs["__module__"] = cls.__module__
    attrs["__qualname__"] = f"{cls.__qualname__}[{platform}]"
    return type(f"{cls.__name__}_{platform}", (cls,), attrs)


def gemm_tiles(m: int, n: int, k: int) -> dict[str, int]:
    """Tile sizes of the GEMM kernels: small fixed tiles under the interpreter (fewer, cheap
    numpy programs), M-bucketed tiles on a GPU (decode-sized M wastes no tensor-core rows)."""
    if interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    return {"BLOCK_M": block_m, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4 if block_m <= 64 else 8,
            "num_stages": 4}
