"""W8A8 int8 scaled GEMM: exact int32 accumulation, per-token x per-channel scales after."""
from __future__ import annotations

from typing import Any

from halserve.platforms.triton_kernels.common import TritonKernel


class TritonInt8ScaledGemm(TritonKernel):
    op = "int8_scaled_gemm"
    dtypes = ("int8",)
    description = "Triton W8A8 int8 GEMM (tl.dot int8 -> int32), scales and bias in the epilogue"

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {"scales_a": ["per_tensor", "per_token"], "scales_b": ["per_tensor", "per_channel"], "bias": True,
                "accumulator": "int32"}

    def __call__(self, a, b, scale_a, scale_b, out_dtype, bias=None):
        from halserve.platforms.triton_kernels.jit.scaled_gemm import scaled_gemm

        return scaled_gemm(a, b, scale_a, scale_b, out_dtype, bias)
