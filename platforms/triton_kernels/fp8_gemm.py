"""W8A8 fp8 scaled GEMM: torch._scaled_mm where the GPU has fp8 tensor cores, Triton elsewhere.

Problem: ``a [M, K]`` fp8 activations with per-token (``[M, 1]``) or per-tensor (``[1]``)
scales, ``b [N, K]`` fp8 weights with per-channel (``[N, 1]``) or per-tensor scales.
"""
from __future__ import annotations

from typing import Any

from halserve.platforms.triton_kernels.common import TritonKernel

_FP8_CUDA = ("float8_e4m3fn", "float8_e5m2")
_FP8_ROCM = ("float8_e4m3fnuz", "float8_e4m3fn")  # MI300 (fnuz), MI350 (OCP)


def _check_fp8(cls, problem: dict[str, Any]) -> str | None:
    fp8 = problem.get("fp8_dtype")
    if fp8 is not None and str(fp8).removeprefix("torch.") not in cls.dtypes:
        return f"fp8 dtype {fp8} not supported (supports {', '.join(cls.dtypes)})"
    return None


class TritonFp8ScaledGemm(TritonKernel):
    op = "fp8_scaled_gemm"
    dtypes = _FP8_CUDA + ("float8_e4m3fnuz",)
    platform_overrides = {"cuda": {"dtypes": _FP8_CUDA}, "rocm": {"dtypes": _FP8_ROCM}}
    description = (
        "Triton W8A8 fp8 GEMM, fp32 accumulation, per-token x per-channel (or per-tensor) scales in the "
        "epilogue; fp8 tensor cores on sm89+/MI300+, operands upcast to fp16 on older GPUs"
    )

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {"scales_a": ["per_tensor", "per_token"], "scales_b": ["per_tensor", "per_channel"], "bias": True}

    @classmethod
    def _supports_problem(cls, **problem: Any) -> str | None:
        return _check_fp8(cls, problem)

    def __init__(self, upcast: bool | None = None) -> None:
        """``upcast``: feed fp16 operands to the dot (GPUs without fp8 tensor cores); default:
        decided by the current device."""
        self.upcast = not _has_fp8_dot() if upcast is None else upcast

    def __call__(self, a, b, scale_a, scale_b, out_dtype, bias=None):
        from halserve.platforms.triton_kernels.jit.scaled_gemm import scaled_gemm

        return scaled_gemm(a, b, scale_a, scale_b, out_dtype, bias, upcast=self.upcast)


def fp8_dot_supported(arch: int | str) -> bool:
    """fp8 x fp8 tl.dot: compute capability (e.g. 90) >= 89 on NVIDIA, gfx94x/gfx95x on AMD."""
    if isinstance(arch, str):
        return arch.startswith(("gfx94", "gfx95"))
    return arch >= 89


def _has_fp8_dot() -> bool:
    """fp8_dot_supported for the current GPU; the interpreter (CPU tests) computes fp8 dots too."""
    import torch

    if not torch.cuda.is_available():
        return True
    if torch.version.hip:
        return fp8_dot_supported(torch.cuda.get_device_properties(0).gcnArchName)
    major, minor = torch.cuda.get_device_capability()
    return fp8_dot_supported(major * 10 + minor)


class CudaScaledMmFp8Gemm(TritonKernel):
    """cuBLASLt fp8 GEMM through ``torch._scaled_mm`` (sm89+); Triton for what it cannot take."""

    op = "fp8_scaled_gemm"
    name = "cuda_scaled_mm"
    platforms = ("cuda",)
    priority = 20
    dtypes = ("float8_e4m3fn",)
    description = (
        "torch._scaled_mm (cuBLASLt fp8, sm89+, N and K multiples of 16): per-tensor scales with any output "
        "dtype, rowwise scales with bf16 output on sm90+; other cases run the Triton kernel"
    )

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {"min_compute_capability": "8.9", "k_multiple_of": 16, "n_multiple_of": 16}

    @classmethod
    def _supports_problem(cls, **problem: Any) -> str | None:
        import torch

        if (reason := _check_fp8(cls, problem)) is not None:
            return reason
        if not torch.cuda.is_available() or torch.version.hip:
            return "needs an NVIDIA GPU (torch.cuda.is_available() is False here)"
        if torch.cuda.get_device_capability() < (8, 9):
            return f"needs compute capability >= 8.9, this GPU is {torch.cuda.get_device_capability()}"
        n, k = problem.get("n"), problem.get("k")
        if (n is not None and n % 16) or (k is not None and k % 16):
            return f"torch._scaled_mm needs N and K multiples of 16 (got N={n}, K={k})"
        return None

    def __init__(self) -> None:
        import torch

        self.rowwise_ok = torch.cuda.get_device_capability() >= (9, 0)
        self.fallback = TritonFp8ScaledGemm()

    def __call__(self, a, b, scale_a, scale_b, out_dtype, bias=None):
        import torch

        m, n = a.shape[0], b.shape[0]
        per_tensor = scale_a.numel() == 1 and scale_b.numel() == 1
        if per_tensor:
            return torch._scaled_mm(
                a, b.t(), scale_a=scale_a.reshape(()).float(), scale_b=scale_b.reshape(()).float(),
                bias=bias, out_dtype=out_dtype,
            )
        if self.rowwise_ok and out_dtype == torch.bfloat16:
            out = torch._scaled_mm(
                a, b.t(),
                scale_a=scale_a.float().reshape(-1, 1).expand(m, 1).contiguous(),
                scale_b=scale_b.float().reshape(1, -1).expand(1, n).contiguous(),
                out_dtype=out_dtype,
            )
            return out if bias is None else out + bias
        return self.fallback(a, b, scale_a, scale_b, out_dtype, bias)
