"""Quantized GEMMs of the cpu platform on torch's own CPU kernels.

4-bit weight-only (GPTQ v1, AutoAWQ GEMM): ``aten._weight_int4pack_mm_for_cpu`` (ATen's
``int4mm_kernel.cpp``), with the weight repacked once at load by
``aten._convert_weight_to_int4pack_for_cpu`` (an ``[N, K/2]`` uint8 layout that depends on
the CPU's ISA: prepare on the machine that runs it). Its dequantization, read from the
source and checked numerically (``tests/platforms/test_cpu_quant_kernels.py``)::

    w[k, n] = (q[n, k] - 8) * s[k // Gt, n] + zf[k // Gt, n]     scales_and_zeros [K/Gt, N, 2] = (s, zf)

with ``Gt`` in {32, 64, 128, 256} and N a multiple of 16. GPTQ/AWQ's ``(q - z) * s`` is the
same with ``zf = (8 - z) * s``. Only its bfloat16 path is vectorized on x86 (AVX2/AVX512):
measured on 2 cores, K = N = 4096, M = 1: bf16 0.39 ms, float32 12.9 ms, float16 21.7 ms
(scalar loops). So every activation dtype runs as bfloat16 (x, s and zf rounded to bf16;
fp32 accumulation; the bf16 output cast back). Measured against the float32 torch reference:
max |error| up to 6e-3 of max |ref| (median 4e-3), where the 4-bit quantization itself is ~1e-1.

Groups: a per-channel weight (``group_size = -1``) or a group of 512 is cut into torch groups
of 256 with repeated scales. GPTQ's act-order ``g_idx`` (any assignment of rows to groups,
including a tensor-parallel rank's subset of the global groups): the K rows are laid out
group by group, each group's run padded with zero-input rows to a multiple of ``Gt``, and
x's columns are gathered into that order on every call (``CpuInt4Weight.src``).

W8A8 int8: ``torch._int_mm`` (ATen's CPU int8 GEMM, exact int32 accumulation; ~2.2 TOPS at
M = 256 on 2 cores here, so AMX/VNNI), then the scales and bias in the reference's order:
bitwise equal to it.

Not here: ``fp8_scaled_gemm`` through ``torch._scaled_mm``. On this CPU build it is correct
(row-wise scales must be ``[M, 1]`` x ``[1, N]`` and contiguous; no float8_e4m3fnuz with
per-tensor scales) but no faster than the reference's dequantize-and-matmul: row-wise is a
dequantizing fallback (K = N = 4096, M = 1: 66 ms vs the reference's 68 ms) and per-tensor
scales are far slower (K = N = 2048: 183 ms at M = 1, 2.8 s at M = 16, reference ~10 ms).
The activation quant ops: ``scaled_int8_quant`` has a native kernel (``fused.py``,
``CpuScaledInt8Quant``); ``scaled_fp8_quant`` keeps the reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from halserve.kernels import packing
from halserve.kernels.base import Kernel

TORCH_GROUP_SIZES = (256, 128, 64, 32)  # what aten._weight_int4pack_mm_for_cpu accepts
N_MULTIPLE = 16  # aten._convert_weight_to_int4pack_for_cpu needs N % 16 == 0
PAD_Q = 8  # the 4-bit value of a padding row (its input is 0, so any value would do)


@dataclass(frozen=True, slots=True)
class CpuInt4Weight:
    """A 4-bit weight repacked for torch's CPU int4 kernel (what ``prepare_weight`` returns)."""

    packed: torch.Tensor  # [N, Kp/2] uint8, torch's ISA-specific int4 layout
    scales_and_zeros: torch.Tensor  # [Kp/Gt, N, 2] bfloat16: (s, zf) of each torch group
    group_size: int  # Gt, the torch op's group size (32, 64, 128 or 256)
    src: torch.Tensor | None  # [Kp] int64: x column feeding each packed row (K = a zero pad); None: identity
    k: int  # input features of x
    n: int  # output features


def rows_layout(g_idx: torch.Tensor, num_groups: int,
                sizes: tuple[int, ...] = TORCH_GROUP_SIZES) -> tuple[torch.Tensor | None, torch.Tensor, int]:
    """Order the K rows group by group, each group's run padded to a multiple of ``Gt`` (one of ``sizes``).

    ``g_idx [K]`` is the group of each row. Returns ``(src [Kp] | None, block_group [Kp/Gt], Gt)``:
    the input row at each position (``K`` for padding; None when it is ``arange(K)``) and the
    group of each torch group. ``Gt`` is the accepted size that pads least, the largest on ties::

        g_idx = [1 0 1 0 ...]  ->  positions [ rows of group 0 | pad ][ rows of group 1 | pad ] ...
    """
    k = g_idx.numel()
    counts = torch.bincount(g_idx, minlength=num_groups)  # [num_groups] rows per group

    def padded_rows(t: int) -> torch.Tensor:
        return (counts + t - 1) // t * t

    gt = min(sizes, key=lambda t: (int(padded_rows(t).sum()), -t))
    padded = padded_rows(gt)
    order = torch.argsort(g_idx, stable=True)  # rows, group by group
    groups = g_idx[order]
    row_in_group = torch.arange(k) - (torch.cumsum(counts, 0) - counts)[groups]
    position = (torch.cumsum(padded, 0) - padded)[groups] + row_in_group
    src = torch.full((int(padded.sum()),), k, dtype=torch.int64)
    src[position] = order
    block_group = torch.repeat_interleave(torch.arange(num_groups), padded // gt)
    if src.numel() == k and torch.equal(src, torch.arange(k)):
        return None, block_group, gt
    return src, block_group, gt


def repack_int4(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> CpuInt4Weight:
    """``q [K, N]`` (0..15), ``zeros``/``scales [num_groups, N]``, ``g_idx [K]`` -> the prepared weight
    for ``w[k, n] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n]``."""
    k, n = q.shape
    src, block_group, gt = rows_layout(g_idx.long(), scales.shape[0])
    q_nk = q.T.to(torch.int32)  # [N, K]
    if src is not None:
        pad = torch.full((n, 1), PAD_Q, dtype=torch.int32)
        q_nk = torch.cat([q_nk, pad], dim=1).index_select(1, src)  # [N, Kp]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q_nk.contiguous(), 1)
    s = scales.float().to(torch.bfloat16)
    zf = ((8 - zeros).float() * s.float()).to(torch.bfloat16)  # from the rounded s: w(q = z) stays ~0
    scales_and_zeros = torch.stack([s, zf], dim=-1)[block_group].contiguous()  # [Kp/Gt, N, 2]
    return CpuInt4Weight(packed, scales_and_zeros, gt, src, k, n)


def _check_packed(name: str, t: torch.Tensor, shape: tuple[int, int], layout: str) -> None:
    if t.dtype != torch.int32 or tuple(t.shape) != shape:
        raise ValueError(f"{name} is {t.dtype} {list(t.shape)}; the {layout} needs int32 {list(shape)}")


def unpack_gptq_args(weight: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight = (qweight [K/8, N], qzeros [num_groups, N/8], scales [num_groups, N], g_idx [K] | None,
    group_size)`` -> ``(q [K, N], zeros [num_groups, N], scales, g_idx [K])``, checked; ``num_groups``
    is K/G, or any count ``g_idx`` indexes (a tensor-parallel rank)."""
    qweight, qzeros, scales, g_idx, group_size = weight
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if g_idx is None:
        g_idx = torch.arange(k) // packing.group_rows(k, group_size)
    elif g_idx.shape != (k,) or g_idx.dtype.is_floating_point:
        raise ValueError(f"g_idx is {g_idx.dtype} {list(g_idx.shape)}; expected integers [K={k}]")
    num_groups = scales.shape[0]
    layout = f"GPTQ v1 packing for K={k}, N={n} with {num_groups} groups"
    _check_packed("qweight", qweight, (k // 8, n), layout)
    _check_packed("qzeros", qzeros, (num_groups, n // 8), layout)
    if tuple(scales.shape) != (num_groups, n):
        raise ValueError(f"scales is {list(scales.shape)}; the {layout} needs [{num_groups}, {n}]")
    if k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups):
        lo, hi = int(g_idx.min()), int(g_idx.max())
        raise ValueError(f"g_idx values must lie in [0, {num_groups}) (the scales' groups), got [{lo}, {hi}]")
    q, zeros = packing.unpack_gptq(qweight, qzeros)  # [K, N], [num_groups, N] with the +1
    return q, zeros, scales, g_idx.long()


def unpack_awq_args(weight: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight = (qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N], group_size)`` -> ``(q [K, N],
    zeros [K/G, N], scales, g_idx [K])``, checked."""
    qweight, qzeros, scales, group_size = weight
    k, n = qweight.shape[0], qweight.shape[1] * 8
    g = packing.group_rows(k, group_size)
    layout = f"AutoAWQ packing for K={k}, N={n}, group_size={group_size}"
    _check_packed("qweight", qweight, (k, n // 8), layout)
    _check_packed("qzeros", qzeros, (k // g, n // 8), layout)
    if tuple(scales.shape) != (k // g, n):
        raise ValueError(f"scales is {list(scales.shape)}; the {layout} needs [{k // g}, {n}]")
    q, zeros = packing.unpack_awq(qweight, qzeros)  # [K, N], [K/G, N]
    return q, zeros, scales, torch.arange(k) // g


class GptqArgs:
    """The ``gptq_gemm`` op's arguments for a CPU kernel class that sets ``prepared_type``, ``repack(q,
    zeros, scales, g_idx)`` (the layout it prepares) and ``run(x, prepared)``."""

    op = "gptq_gemm"

    def prepare_weight(self, weight: tuple):
        if isinstance(weight, self.prepared_type):
            return weight
        return self.repack(*unpack_gptq_args(weight))

    def __call__(self, x, qweight, qzeros=None, scales=None, g_idx=None, group_size=None) -> torch.Tensor:
        if not isinstance(qweight, self.prepared_type):  # unprepared: repack on every call (tests, conformance)
            qweight = self.prepare_weight((qweight, qzeros, scales, g_idx, group_size))
        return self.run(x, qweight)


class AwqArgs:
    """The ``awq_gemm`` op's arguments; as ``GptqArgs``."""

    op = "awq_gemm"

    def prepare_weight(self, weight: tuple):
        if isinstance(weight, self.prepared_type):
            return weight
        return self.repack(*unpack_awq_args(weight))

    def __call__(self, x, qweight, qzeros=None, scales=None, group_size=None) -> torch.Tensor:
        if not isinstance(qweight, self.prepared_type):
            qweight = self.prepare_weight((qweight, qzeros, scales, group_size))
        return self.run(x, qweight)


class _CpuInt4Gemm(Kernel):
    name = "torch_int4pack"
    platforms = ("cpu",)
    priority = 8  # below IPEX's 4-bit kernels (10), which compute float32 exactly when installed
    dtypes = ("float32", "float16", "bfloat16")
    prepared_type = CpuInt4Weight
    repack = staticmethod(repack_int4)

    @classmethod
    def capabilities(cls) -> dict:
        return {"compute_dtype": "bfloat16", "n_multiple_of": N_MULTIPLE, "group_size_multiple_of": 32}

    @classmethod
    def _supports(cls, **problem) -> str | None:
        import platform

        if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            return f"torch {torch.__version__} has no aten._weight_int4pack_mm_for_cpu"
        if platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
            return "torch's CPU int4 kernel is only vectorized with AVX2 or AVX512 (this CPU has neither)"
        n, k, group_size = problem.get("n"), problem.get("k"), problem.get("group_size")
        if n is not None and n % N_MULTIPLE:
            return f"torch's CPU int4 kernel needs N a multiple of {N_MULTIPLE} (got N={n})"
        rows = k if group_size == -1 else group_size
        if rows is not None and rows % 32:
            return (f"torch's CPU int4 kernel takes groups of {', '.join(map(str, TORCH_GROUP_SIZES))} rows: "
                    f"group_size {group_size} (K={k}) is not a multiple of 32")
        return None

    @staticmethod
    def run(x: torch.Tensor, w: CpuInt4Weight) -> torch.Tensor:
        if x.shape[-1] != w.k:
            raise ValueError(f"x has {x.shape[-1]} input features; the weight was prepared for K={w.k}")
        xb = x.reshape(-1, w.k).to(torch.bfloat16)  # [M, K]
        if w.src is not None:
            if w.src.numel() > w.k:
                xb = F.pad(xb, (0, 1))  # column K: the zero input of padding rows
            xb = xb.index_select(1, w.src)  # [M, Kp] in the packed row order
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(xb.contiguous(), w.packed, w.group_size, w.scales_and_zeros)
        return out.to(x.dtype).reshape(*x.shape[:-1], w.n)


class CpuInt4GptqGemm(GptqArgs, _CpuInt4Gemm):
    description = (
        "torch's CPU int4 kernel (aten._weight_int4pack_mm_for_cpu) on a weight repacked once at load; "
        "computes in bfloat16 for every activation dtype (its float32/float16 paths are scalar), "
        "act-order g_idx by a column gather of x per call"
    )


class CpuInt4AwqGemm(AwqArgs, _CpuInt4Gemm):
    description = (
        "torch's CPU int4 kernel (aten._weight_int4pack_mm_for_cpu) on a weight repacked once at load; "
        "computes in bfloat16 for every activation dtype (its float32/float16 paths are scalar)"
    )


def _scale_column(scale: torch.Tensor, rows: int) -> torch.Tensor:
    # [1] | [rows] | [rows, 1] -> [1, 1] | [rows, 1] float32 (broadcasts like the reference's expand)
    return scale.float().reshape(1, 1) if scale.numel() == 1 else scale.float().reshape(rows, 1)


class CpuInt8ScaledGemm(Kernel):
    op = "int8_scaled_gemm"
    name = "torch_int_mm"
    platforms = ("cpu",)
    priority = 10
    dtypes = ("int8",)
    description = "torch._int_mm (oneDNN int8 x int8 -> exact int32), then the scales and bias in float32"

    @classmethod
    def _supports(cls, **problem) -> str | None:
        if not hasattr(torch, "_int_mm"):
            return f"torch {torch.__version__} has no torch._int_mm"
        return None

    def __call__(self, a, b, scale_a, scale_b, out_dtype, bias=None) -> torch.Tensor:
        m, n = a.shape[0], b.shape[0]
        acc = torch._int_mm(a.contiguous(), b.contiguous().t())  # [M, N] int32; b [N, K] read as [K, N]
        # the reference's order (acc * sa) * sb + bias, in float32: bitwise the same result
        out = acc.to(torch.float32).mul_(_scale_column(scale_a, m)).mul_(_scale_column(scale_b, n).T)
        if bias is not None:
            out.add_(bias.float())
        return out.to(out_dtype)
