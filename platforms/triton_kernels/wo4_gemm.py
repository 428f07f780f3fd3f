"""4-bit weight-only GEMMs: AutoAWQ GEMM and GPTQ v1 packings (see ``halserve.kernels.packing``)."""
from __future__ import annotations

from typing import Any

from halserve.platforms.triton_kernels.common import TritonKernel

_GROUP_SIZES = (32, 64, 128, -1)


class _Wo4Gemm(TritonKernel):
    dtypes = ("float16", "bfloat16", "float32")
    group_sizes = _GROUP_SIZES

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {"bits": 4, "group_sizes": list(cls.group_sizes), "n_multiple_of": 8}

    @classmethod
    def _supports_problem(cls, **problem: Any) -> str | None:
        g, n, k = problem.get("group_size"), problem.get("n"), problem.get("k")
        if g is not None and g not in cls.group_sizes:
            return f"group size {g} not supported (supports {', '.join(map(str, cls.group_sizes))}; -1 = per channel)"
        if n is not None and n % 8:
            return f"N={n} is not a multiple of 8 (8 nibbles per int32)"
        if k is not None and g not in (None, -1) and k % g:
            return f"K={k} is not a multiple of group size {g}"
        return None


class TritonAwqGemm(_Wo4Gemm):
    op = "awq_gemm"
    description = "Triton AWQ W4A16 GEMM: unpacks AutoAWQ nibbles (0,2,4,6,1,3,5,7) and dequantizes in registers"

    def __call__(self, x, qweight, qzeros, scales, group_size):
        from halserve.platforms.triton_kernels.jit.wo4_gemm import wo4_gemm

        return wo4_gemm(x, qweight, qzeros, scales, None, group_size, is_awq=True)


class TritonGptqGemm(_Wo4Gemm):
    op = "gptq_gemm"
    description = "Triton GPTQ v1 W4A16 GEMM (nibbles along K, zero + 1), act-order g_idx supported"

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {**super().capabilities(), "act_order_g_idx": True, "zero_convention": "v1 (stored zero - 1)"}

    def __call__(self, x, qweight, qzeros, scales, g_idx, group_size):
        from halserve.platforms.triton_kernels.jit.wo4_gemm import wo4_gemm

        return wo4_gemm(x, qweight, qzeros, scales, g_idx, group_size, is_awq=False)
