"""Activation quantization ops feeding the W8A8 GEMMs: ``scaled_fp8_quant``, ``scaled_int8_quant``."""
from __future__ import annotations

from typing import Any

from halserve.platforms.triton_kernels.common import FLOATS, TritonKernel


class TritonScaledFp8Quant(TritonKernel):
    op = "scaled_fp8_quant"
    dtypes = FLOATS
    fp8_dtypes = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz")
    platform_overrides = {
        "cuda": {"fp8_dtypes": ("float8_e4m3fn", "float8_e5m2")},
        "rocm": {"fp8_dtypes": ("float8_e4m3fnuz", "float8_e4m3fn")},
    }
    description = "Triton fp8 quantization: static per-tensor, dynamic per-tensor or dynamic per-token scales"

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {"fp8_dtypes": list(cls.fp8_dtypes), "modes": ["static", "dynamic_per_tensor", "dynamic_per_token"]}

    @classmethod
    def _supports_problem(cls, **problem: Any) -> str | None:
        fp8 = problem.get("fp8_dtype")
        if fp8 is not None and str(fp8).removeprefix("torch.") not in cls.fp8_dtypes:
            return f"fp8 dtype {fp8} not supported (supports {', '.join(cls.fp8_dtypes)})"
        return None

    def __call__(self, x, fp8_dtype, scale=None, per_token=False):
        import torch

        from halserve.platforms.triton_kernels.jit.quant import quantize

        fp8 = getattr(torch, fp8_dtype) if isinstance(fp8_dtype, str) else fp8_dtype
        return quantize(x, fp8, scale, per_token)


class TritonScaledInt8Quant(TritonKernel):
    op = "scaled_int8_quant"
    dtypes = FLOATS
    description = "Triton symmetric int8 quantization (round half to even): static per-tensor or dynamic per-token"

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {"modes": ["static", "dynamic_per_token"], "symmetric": True}

    def __call__(self, x, scale=None):
        import torch

        from halserve.platforms.triton_kernels.jit.quant import quantize

        return quantize(x, torch.int8, scale, per_token=True)
