"""W8A8 int8 GEMM through oneDNN with the weight prepacked once at load: the cpu platform's fallback on
AMX CPUs where the native kernel (native_int8.py) cannot be built.

``onednn::qlinear_prepack`` reorders the ``[N, K]`` weight once into oneDNN's blocked layout
(``torch_int_mm`` has oneDNN reorder it on every call) and ``onednn::qlinear_pointwise`` multiplies
against it with exact int32 sums::

    static x scale (one value)     oneDNN applies scale_a * scale_b and the bias and writes bfloat16 /
                                   float32 directly (float16 output: the per-token route)
    per-token x scales             oneDNN writes the sums as float32 (unit scales); int8_gemm.cpp's
                                   scaled_epilogue computes (acc * scale_a) * scale_b + bias, rounded
                                   once to the output dtype (torch ops where it cannot be built)

torch's op takes no per-row source scale, hence the second pass.

Only with AMX-INT8. oneDNN multiplies int8 x int8 natively only with AMX; without it, its one fast exact
path is uint8 x int8 on AVX512-VNNI (x + 128 with source zero point 128). Measured on this project's
2-core Xeon with ``ONEDNN_MAX_CPU_ISA`` lowering oneDNN's ISA: int8 x on AVX512-VNNI took 2.1 s at
M = 64, K = 768, N = 2304 (a reference fallback); uint8 x was 0.6x ``torch_int_mm`` at M = 1, 1.0-1.15x at
M = 64, 1.2-1.7x at M = 2048 (W1 end to end +5%); AVX2 without VNNI returned wrong sums (saturating
uint8 * int8 pairs). So without AMX this kernel declines and ``torch_int_mm`` serves.

Tolerance against ``TorchInt8ScaledGemm``: per-token scales, and float16 output: bitwise equal. Static
scales with bfloat16 / float32 output: oneDNN forms the scales' product and the bias sum in its own order;
measured |error| <= 2 eps (of the output dtype) x (|acc scale_a scale_b| + |bias|).
"""
from __future__ import annotations

import functools
import os

import torch

from halserve.kernels.base import Kernel

# oneDNN's ISA cap (either name): below AMX, int8 x runs a slow reference path
ISA_ENV_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


@functools.cache
def unsupported_reason() -> str | None:
    """Why oneDNN's int8 x int8 matmul is not native here, or None."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    if not hasattr(torch.ops.onednn, "qlinear_prepack") or not hasattr(torch.ops.onednn, "qlinear_pointwise"):
        return f"torch {torch.__version__} has no onednn::qlinear_prepack / qlinear_pointwise"
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    if not (caps.get("amx_int8") and caps.get("amx_tile")):
        return ("oneDNN's int8 x int8 matmul is native only with AMX-INT8 (this CPU has none; its VNNI path measured "
                "no better than torch_int_mm at decode sizes)")
    cap = next((os.environ[v].upper() for v in ISA_ENV_VARS if os.environ.get(v)), "ALL")
    if cap != "ALL" and "AMX" not in cap:
        return f"oneDNN's ISA is capped below AMX ({cap}, {' / '.join(ISA_ENV_VARS)}): int8 x int8 would run slowly"
    if not torch._C._cpu._init_amx():
        return "the OS refused this process AMX tile data (arch_prctl)"
    return None


@functools.cache
def _native_epilogue():
    """int8_gemm.cpp's ``scaled_epilogue``, or None where it cannot be built."""
    from halserve.platforms.cpu_kernels.native_int8 import load_int8_ops

    return None if load_int8_ops() else torch.ops.halserve_cpu_int8.scaled_epilogue


def torch_epilogue(acc, scale_a, scale_b, bias, out_dtype) -> torch.Tensor:
    """``scaled_epilogue`` as torch ops: ``(acc * scale_a) * scale_b + bias`` in float32, then out_dtype."""
    m, n = acc.shape
    sa = scale_a.float().reshape(1, 1) if scale_a.numel() == 1 else scale_a.float().reshape(m, 1)
    sb = scale_b.float().reshape(1, 1) if scale_b.numel() == 1 else scale_b.float().reshape(1, n)
    out = acc.mul_(sa).mul_(sb)
    if bias is not None:
        out.add_(bias.float())
    return out.to(out_dtype)


class OneDnnInt8ScaledGemm(Kernel):
    op = "int8_scaled_gemm"
    name = "onednn_int8"
    platforms = ("cpu",)
    priority = 20  # below the native kernel (30), above torch_int_mm (10)
    dtypes = ("int8",)
    description = ("oneDNN int8 matmul (onednn::qlinear_pointwise, exact int32 sums) on a weight prepacked once at "
                   "load; per-token scales and bias in one C++ pass")

    @classmethod
    def capabilities(cls) -> dict:
        return {"isa": "AMX-INT8"}

    @classmethod
    def _supports(cls, **problem) -> str | None:
        n, k = problem.get("n"), problem.get("k")
        if n == 0 or k == 0:
            return f"oneDNN's int8 matmul needs N, K >= 1 (got N={n}, K={k})"
        return unsupported_reason()

    def __init__(self) -> None:
        reason = unsupported_reason()
        if reason is not None:
            raise RuntimeError(f"the oneDNN int8 GEMM cannot run here: {reason}")
        self.epilogue = _native_epilogue() or torch_epilogue
        self.unit_scale = torch.ones(1)
        self.zero_point = torch.zeros(1, dtype=torch.int32)

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [N, K]`` int8 -> an opaque oneDNN (MkldnnCPU) tensor in its blocked layout."""
        if weight.is_mkldnn:
            return weight
        if weight.dtype != torch.int8 or weight.dim() != 2 or 0 in weight.shape:
            raise ValueError(f"the int8 GEMM's weight must be int8 [N, K] with N, K >= 1, got {weight.dtype} "
                             f"{list(weight.shape)}")
        return torch.ops.onednn.qlinear_prepack(weight.detach().contiguous(), None)

    def __call__(self, a, b, scale_a, scale_b, out_dtype, bias=None) -> torch.Tensor:
        w = self.prepare_weight(b)  # unprepared (tests, conformance): reordered on every call
        k = w.size(0)  # the prepacked weight reads as [K, N]
        if a.dtype != torch.int8 or a.dim() != 2 or a.shape[1] != k:
            raise ValueError(f"a is {a.dtype} {list(a.shape)}; the weight was prepared for int8 [M, K={k}]")
        x = a.contiguous()
        qlinear = torch.ops.onednn.qlinear_pointwise
        if scale_a.numel() == 1 and out_dtype in (torch.bfloat16, torch.float32):
            # one call: oneDNN scales by scale_a * scale_b, adds the bias, writes out_dtype
            sb = scale_b.reshape(-1).float().contiguous()
            return qlinear(x, float(scale_a), 0, w, sb, self.zero_point, bias, 1.0, 0, out_dtype, "none", [], "")
        # [M, N] float32: the exact int32 sums (unit scales)
        acc = qlinear(x, 1.0, 0, w, self.unit_scale, self.zero_point, None, 1.0, 0, torch.float32,
                      "none", [], "")
        return self.epilogue(acc, scale_a, scale_b, bias, out_dtype)
