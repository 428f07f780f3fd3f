"""Block-wise ("fine-grained") fp8, as DeepSeek-V3 and Qwen3-FP8 checkpoints store it.

``quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}``:
weights ``[N, K]`` fp8 with one scale per 128 x 128 block (``weight_scale_inv``), activations
quantized per token per 128 input features at run time. Two ops:
``per_token_group_fp8_quant`` (the activations) and ``fp8_block_scaled_gemm``.

Registered through ``kernels_for`` (``common.py``) with the other Triton kernels.
"""
from __future__ import annotations

from typing import Any

from halserve.platforms.triton_kernels.common import FLOATS, TritonKernel
from halserve.platforms.triton_kernels.fp8_gemm import _FP8_CUDA, _FP8_ROCM, _check_fp8, _has_fp8_dot

MIN_BLOCK_K = 16  # the smallest K tile tl.dot takes


def _check_block_size(block_size: Any) -> str | None:
    if block_size is None:
        return None
    if not isinstance(block_size, (tuple, list)) or len(block_size) != 2:
        return f"block_size must be (Bn, Bk), got {block_size!r}"
    block_n, block_k = block_size
    if block_n < 1:
        return f"block_size {tuple(block_size)}: Bn must be positive"
    if block_k < MIN_BLOCK_K or block_k & (block_k - 1):
        # K tiles are powers of two that must not straddle two k-blocks
        return f"block_size {tuple(block_size)}: Bk={block_k} must be a power of two >= {MIN_BLOCK_K}"
    return None


class TritonFp8BlockScaledGemm(TritonKernel):
    op = "fp8_block_scaled_gemm"
    dtypes = _FP8_CUDA + ("float8_e4m3fnuz",)
    platform_overrides = {"cuda": {"dtypes": _FP8_CUDA}, "rocm": {"dtypes": _FP8_ROCM}}
    description = (
        "Triton fp8 GEMM with per-token-group x 2-D block scales (DeepSeek-V3 style) applied per K tile, "
        "fp32 accumulation; fp8 tensor cores on sm89+/MI300+, operands upcast to fp16 on older GPUs"
    )

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {"block_k": f"power of two >= {MIN_BLOCK_K}", "block_n": "any", "bias": True,
                "k_and_n_tails": True}

    @classmethod
    def _supports_problem(cls, **problem: Any) -> str | None:
        return _check_fp8(cls, problem) or _check_block_size(problem.get("block_size"))

    def __init__(self, upcast: bool | None = None) -> None:
        """``upcast``: feed fp16 operands to the dot (GPUs without fp8 tensor cores); default:
        decided by the current device."""
        self.upcast = not _has_fp8_dot() if upcast is None else upcast

    def __call__(self, a, b, scale_a, scale_b, block_size, out_dtype, bias=None):
        from halserve.platforms.triton_kernels.jit.fp8_block_gemm import fp8_block_gemm

        return fp8_block_gemm(a, b, scale_a, scale_b, block_size, out_dtype, bias, upcast=self.upcast)


class TritonPerTokenGroupFp8Quant(TritonKernel):
    op = "per_token_group_fp8_quant"
    dtypes = FLOATS
    fp8_dtypes = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz")
    platform_overrides = {
        "cuda": {"fp8_dtypes": ("float8_e4m3fn", "float8_e5m2")},
        "rocm": {"fp8_dtypes": ("float8_e4m3fnuz", "float8_e4m3fn")},
    }
    description = "Triton dynamic fp8 quantization with one scale per token per group of G input features"

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {"fp8_dtypes": list(cls.fp8_dtypes), "group_sizes": "any (128 in DeepSeek-V3 / Qwen3-FP8)"}

    @classmethod
    def _supports_problem(cls, **problem: Any) -> str | None:
        fp8, group = problem.get("fp8_dtype"), problem.get("group_size")
        if fp8 is not None and str(fp8).removeprefix("torch.") not in cls.fp8_dtypes:
            return f"fp8 dtype {fp8} not supported (supports {', '.join(cls.fp8_dtypes)})"
        if group is not None and group < 1:
            return f"group size {group} must be positive"
        return None

    def __call__(self, x, fp8_dtype, group_size):
        import torch

        from halserve.platforms.triton_kernels.jit.fp8_block_gemm import per_token_group_quant

        fp8 = getattr(torch, fp8_dtype) if isinstance(fp8_dtype, str) else fp8_dtype
        return per_token_group_quant(x, fp8, group_size)


BLOCK_FP8_KERNELS: tuple[type[TritonKernel], ...] = (TritonFp8BlockScaledGemm, TritonPerTokenGroupFp8Quant)
"""What the cuda and rocm plugins register (through ``common.for_platform``)."""
