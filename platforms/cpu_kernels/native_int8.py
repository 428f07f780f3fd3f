"""The cpu platform's own W8A8 int8 GEMM (``int8_scaled_gemm``) on AMX int8 tiles, in C++ (``int8_gemm.cpp``).

``torch_int_mm`` (quant_gemm.py) hands oneDNN the checkpoint's ``[N, K]`` weight transposed, so oneDNN
reorders all of it on every call, and then scales in three more float32 passes. Here the weight is
packed once at load into AMX B tiles; each thread takes a run of 32-column panels, in blocks of ~512 KB
that stay in L2 while 32 rows at a time go across them (the first pass prefetching each next panel: at
decode the weight streams from memory), ``tdpbssd`` sums int8 x int8 exactly in int32, and the epilogue
writes ``(acc * scale_a) * scale_b + bias`` straight to the output dtype, in the reference's order:
bitwise ``TorchInt8ScaledGemm`` for every scale granularity and output dtype.

Where AMX-INT8 is missing (or the toolchain, or the OS refuses AMX) this kernel declines: ``onednn_int8``
(onednn_int8_gemm.py: oneDNN on a prepacked weight, AMX too) serves where only the build failed, else
``torch_int_mm``.

Measured on this project's 2-core Xeon (AMX; bfloat16 output, per-token scales; ms per call, medians of
alternating rounds, ``benchmarks/kernels/cpu_int8_gemm.py``). W1's decode shapes at M = 64, the weights
streamed from memory as in a decode step (K x N: 768 x 1280, 768 x 768, 768 x 4096, 2048 x 768):
this kernel 0.079 / 0.046 / 0.264 / 0.106, ``onednn_int8`` 0.128 / 0.086 / 0.374 / 0.170, ``torch_int_mm``
0.169 / 0.114 / 0.610 / 0.214, dense bf16 0.140 / 0.090 / 0.480 / 0.277. A 2,048-row prefill at
768 x 4096: 3.3 ms, against 5.6 / 14.4 / 5.3. W1-w8a8 end to end in bfloat16 (``halserve bench
throughput``): 1161 -> 1665 output tok/s (``torch_int_mm`` -> this kernel, medians of three).

``load_int8_ops()`` builds ``int8_gemm.cpp`` as its own small library (``torch.ops.halserve_cpu_int8``),
apart from the platform's others.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from halserve.kernels.base import Kernel
from halserve.platforms.cpu_kernels.panel import cpu_flags

logger = logging.getLogger(__name__)

BLOCK_K = 64  # k per block: an int8 AMX tile row holds 16 columns x 4 k
PANEL_N = 32  # columns per panel: two 16-column tiles


def load_int8_ops() -> str | None:
    """Build int8_gemm.cpp once per machine (the ``int8`` library of ``cpu_kernels.LIBRARIES``, cached by
    ``build.py``), registering ``torch.ops.halserve_cpu_int8``; None when its ops are there, else why not
    (logged once)."""
    from halserve.platforms import cpu_kernels

    cpu_kernels.load_library("int8")
    return cpu_kernels.load_error("int8")


@dataclass(frozen=True, slots=True)
class NativeInt8Weight:
    """An int8 weight ``[N, K]`` in the native kernel's layout (what ``prepare_weight`` returns)."""

    qpack: torch.Tensor  # [Np/32, Kp/64, 2, 16, 64] int8: per panel and k block, two AMX B tiles
    k: int  # input features
    n: int  # output features


def pack_int8(b: torch.Tensor) -> NativeInt8Weight:
    """``b [N, K]`` int8 -> the B-tile order, N padded to a multiple of 32 and K of 64 with zeros::

        qpack[p, kb, t, r, j] = b[32 p + 16 t + j // 4, 64 kb + 4 r + j % 4]
    """
    if b.dtype != torch.int8 or b.dim() != 2:
        raise ValueError(f"the int8 GEMM's weight must be int8 [N, K], got {b.dtype} {list(b.shape)}")
    n, k = b.shape
    np_, kp = -(-n // PANEL_N) * PANEL_N, -(-k // BLOCK_K) * BLOCK_K
    padded = torch.nn.functional.pad(b.detach(), (0, kp - k, 0, np_ - n))  # [Np, Kp]
    # [P, t, c, KB, r, i] (n = 32 p + 16 t + c, k = 64 kb + 4 r + i) -> [P, KB, t, r, c, i]
    tiles = padded.reshape(np_ // PANEL_N, 2, 16, kp // BLOCK_K, 16, 4).permute(0, 3, 1, 4, 2, 5)
    return NativeInt8Weight(tiles.reshape(np_ // PANEL_N, kp // BLOCK_K, 2, 16, 64).contiguous(), k, n)


class NativeInt8ScaledGemm(Kernel):
    op = "int8_scaled_gemm"
    name = "cpu_native"
    platforms = ("cpu",)
    priority = 30  # above onednn_int8 (20) and torch_int_mm (10), which serve where this declines
    dtypes = ("int8",)
    description = ("C++ int8 GEMM on AMX tiles (exact int32 sums) over a weight packed once at load, the scales "
                   "and bias in one epilogue: bitwise the reference")

    @classmethod
    def capabilities(cls) -> dict:
        return {"isa": "AMX-INT8"}

    @classmethod
    def _supports(cls, **problem) -> str | None:
        n, k = problem.get("n"), problem.get("k")
        if n == 0 or k == 0:  # first, as oneDNN's sibling does: no CPU runs an empty weight
            return f"the native int8 GEMM needs N, K >= 1 (got N={n}, K={k})"
        if not {"amx_tile", "amx_int8"} <= cpu_flags():
            return "the native int8 GEMM needs AMX-INT8 (this CPU's /proc/cpuinfo flags lack amx_tile/amx_int8)"
        error = load_int8_ops()
        if error is not None:
            return error
        if not torch.ops.halserve_cpu_int8.amx_int8_ready():
            return "int8_gemm.cpp was built without AMX-INT8, or the OS refused this process AMX tile data"
        return None

    def __init__(self) -> None:
        reason = self._supports()
        if reason is not None:
            raise RuntimeError(f"the native int8 GEMM cannot run here: {reason}")
        self.gemm = torch.ops.halserve_cpu_int8.amx_int8_gemm

    def prepare_weight(self, weight: torch.Tensor | NativeInt8Weight) -> NativeInt8Weight:
        return weight if isinstance(weight, NativeInt8Weight) else pack_int8(weight)

    def __call__(self, a, b, scale_a, scale_b, out_dtype, bias=None) -> torch.Tensor:
        w = self.prepare_weight(b)  # unprepared (tests, conformance): packed on every call
        if a.dtype != torch.int8 or a.dim() != 2 or a.shape[1] != w.k:
            raise ValueError(f"a is {a.dtype} {list(a.shape)}; the weight was prepared for int8 [M, K={w.k}]")
        return self.gemm(a, w.qpack, scale_a, scale_b, bias, w.n, out_dtype)
