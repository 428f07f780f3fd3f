"""The cpu platform's own fp8 W8A8 GEMMs (``fp8_scaled_gemm``, ``fp8_block_scaled_gemm``), in C++
(``fp8_gemm.cpp`` on the panel GEMM of ``panel_gemm.h``, with the 4-bit kernels of ``native_int4.py``).

This CPU has no fp8 arithmetic, and torch's CPU fp8 GEMMs dequantize the whole weight on every call
(~67 ms at K = N = 4096, M = 1: fp8 checkpoints ran ~50x slower than bf16 ones). Here both operands
become bf16 one panel at a time, exactly (fp8 values fit bf16), and AMX (or AVX512-BF16) sums them
in float32, so the results equal the reference's up to float32 summation order: per-token/channel/
tensor scales are applied once at the end, block scales (DeepSeek-V3 style) to each group's sums.

The weight is repacked once at load (``prepare_weight``) into the AMX B-tile byte order; checkpoints
hold no NaN weights (an e4m3fn NaN byte would read as 480).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from halserve.kernels.base import Kernel
from halserve.platforms.cpu_kernels.native_int4 import PANEL_N
from halserve.platforms.cpu_kernels.panel import PanelKernel

BLOCK_K = 32
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")


@dataclass(frozen=True, slots=True)
class NativeFp8Weight:
    """An fp8 weight [N, K] in the native kernel's layout (what ``prepare_weight`` returns)."""

    qpack: torch.Tensor  # [Np/16, Kp/32, 16, 32] uint8: the fp8 bytes in AMX B-tile order
    dtype: torch.dtype  # the fp8 flavour of the bytes
    k: int
    n: int


def pack_fp8(b: torch.Tensor) -> NativeFp8Weight:
    """``b [N, K]`` fp8 -> the B-tile order: byte j of tile row r of (column tile t, block kb) is
    ``b[16 t + j // 2, 32 kb + 2 r + j % 2]``; N padded to 32 and K to 32 with +0.0."""
    n, k = b.shape
    np_, kp = -(-n // PANEL_N) * PANEL_N, -(-k // BLOCK_K) * BLOCK_K
    raw = torch.nn.functional.pad(b.contiguous().view(torch.uint8), (0, kp - k, 0, np_ - n))  # [Np, Kp]
    # [Kp, Np] -> [KB, r, pair, T, c] -> [T, KB, r, c, pair] = [T, KB, 16, 32 bytes j = 2 c + pair]
    tiles = raw.T.reshape(kp // BLOCK_K, 16, 2, np_ // 16, 16).permute(3, 0, 1, 4, 2)
    return NativeFp8Weight(tiles.reshape(np_ // 16, kp // BLOCK_K, 16, 32).contiguous(), b.dtype, k, n)


class _NativeFp8Gemm(PanelKernel):
    library = "fp8"
    priority = 10
    dtypes = FP8_DTYPES

    @classmethod
    def _supports(cls, **problem) -> str | None:
        fp8 = problem.get("fp8_dtype")
        if fp8 is not None and fp8 not in FP8_DTYPES:
            return f"fp8 flavour {fp8} is not supported (supports {', '.join(FP8_DTYPES)})"
        return super()._supports(**problem)

    def prepare_weight(self, weight):
        return weight if isinstance(weight, NativeFp8Weight) else pack_fp8(weight)

    def run(self, a, b, scale_a, scale_b, out_dtype, bias, block: tuple[int, int]) -> torch.Tensor:
        w = self.prepare_weight(b)
        if a.dtype != w.dtype:
            raise ValueError(f"a is {a.dtype} and the weight {w.dtype}: both operands must be the same fp8 flavour")
        if a.dim() != 2 or a.shape[1] != w.k:
            raise ValueError(f"a is {list(a.shape)}; the weight was prepared for [M, K={w.k}]")
        out_bf16 = out_dtype == torch.bfloat16
        out = torch.ops.halserve_cpu.fp8_gemm(a, w.qpack, scale_a, scale_b, bias, w.n, block[0], block[1], out_bf16,
                                              self.isa == "amx")
        return out if out.dtype == out_dtype else out.to(out_dtype)


class NativeFp8ScaledGemm(_NativeFp8Gemm):
    op = "fp8_scaled_gemm"
    description = ("C++: fp8 operands to bf16 (exact) one L2-resident panel at a time, AMX (AVX512-BF16 without AMX) "
                   "float32 sums, scales applied once at the end")

    def __call__(self, a, b, scale_a, scale_b, out_dtype, bias=None) -> torch.Tensor:
        return self.run(a, b, scale_a, scale_b, out_dtype, bias, (0, 0))


class NativeFp8BlockScaledGemm(_NativeFp8Gemm):
    op = "fp8_block_scaled_gemm"
    description = ("C++: fp8 operands to bf16 (exact) one L2-resident panel at a time, AMX (AVX512-BF16 without AMX) "
                   "float32 sums scaled per block")

    @classmethod
    def capabilities(cls) -> dict:
        return {"block_size_multiple_of": [16, 32]}

    @classmethod
    def _supports(cls, **problem) -> str | None:
        block = problem.get("block_size")
        if block is not None and (block[0] % 16 or block[1] % BLOCK_K):
            return f"block size {tuple(block)} is not a multiple of (16, 32)"
        return super()._supports(**problem)

    def __call__(self, a, b, scale_a, scale_b, block_size, out_dtype, bias=None) -> torch.Tensor:
        block_n, block_k = (int(v) for v in block_size)
        if block_n % 16 or block_k % BLOCK_K:
            raise ValueError(f"block size {tuple(block_size)} is not a multiple of (16, 32)")
        return self.run(a, b, scale_a, scale_b, out_dtype, bias, (block_n, block_k))


class _NativeFp8Quant(Kernel):
    name = "cpu_native"
    platforms = ("cpu",)
    priority = 10
    dtypes = ("float32", "bfloat16")

    @classmethod
    def _supports(cls, **problem) -> str | None:
        from halserve.platforms.cpu_kernels import toolchain_missing

        fp8 = problem.get("fp8_dtype")
        if fp8 is not None and fp8 not in FP8_DTYPES:
            return f"fp8 flavour {fp8} is not supported (supports {', '.join(FP8_DTYPES)})"
        return toolchain_missing()

    def __init__(self) -> None:
        from halserve.platforms import cpu_kernels

        if cpu_kernels.load_library("fp8") is None:  # builds it once; it registers torch.ops.halserve_cpu.fp8_quant
            raise RuntimeError(f"{self.op}/cpu_native: {cpu_kernels.load_error('fp8')}")

    @staticmethod
    def quantize(x: torch.Tensor, fp8_dtype, scale: torch.Tensor | None, group: int):
        fp8 = getattr(torch, fp8_dtype) if isinstance(fp8_dtype, str) else fp8_dtype
        if str(fp8).replace("torch.", "") not in FP8_DTYPES:
            raise ValueError(f"fp8 flavour {fp8} is not supported here (supports {', '.join(FP8_DTYPES)})")
        return torch.ops.halserve_cpu.fp8_quant(x, fp8 == torch.float8_e5m2, scale, group)


class NativeScaledFp8Quant(_NativeFp8Quant):
    op = "scaled_fp8_quant"
    description = "static, per-tensor or per-token fp8 quant in C++ (one pass for the amax, one writing fp8)"

    def __call__(self, x, fp8_dtype, scale=None, per_token=False):
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        q, s = self.quantize(x2, fp8_dtype, scale, x2.shape[1] if per_token and scale is None else 0)
        return q.reshape(x.shape), s


class NativePerTokenGroupFp8Quant(_NativeFp8Quant):
    op = "per_token_group_fp8_quant"
    description = "per-token-group fp8 quant in C++ (each group's amax, then fp8)"

    def __call__(self, x, fp8_dtype, group_size):
        if group_size < 1:
            raise ValueError(f"group_size must be a positive int (128 for DeepSeek-V3-style fp8), got {group_size}")
        return self.quantize(x, fp8_dtype, None, int(group_size))
