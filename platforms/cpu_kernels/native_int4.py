"""The cpu platform's own 4-bit weight-only GEMMs (GPTQ v1, AutoAWQ GEMM), in C++ (``int4_gemm.cpp``).

Each call dequantizes the weight one 32-column panel at a time into a bf16 buffer that stays in
L2 and multiplies it there with AMX tiles (AVX512-BF16 dot products where AMX is absent or the OS
refuses it), accumulating in float32. torch's int4 kernel (``torch_int4pack``) re-dequantizes the
weight for every 4 rows of x, so it loses to the dense bf16 GEMM from ~4 rows on (W1's 64-row decode
steps and 2,048-token prefills); here a panel serves up to ~1 MB of x, so prefill runs near the
dense GEMM's rate. Figures: BENCHMARKS.md "Quantized checkpoints on the CPU".

Up to four rows of x (decode of a few sequences) no bf16 weight is written: the packed nibbles become
``bf16(128 + q)`` by one OR, the products with x are exact, and each group's sums are centred and
scaled once (``sum s (x (128 + q) - (128 + z) x)``); there it beats torch's int4 kernel at M = 1.

Arithmetic: x rounded to bf16, float32 accumulation, the output in x's dtype. From five rows on the
weight is ``w = q * s + zf`` in float32 (``zf = -z * s``, exact for fp16 scales) rounded once to bf16;
up to four rows it is exact. So every activation dtype computes in bfloat16, as ``torch_int4pack``
does (``compute_dtype`` bfloat16).

Layout (``NativeInt4Weight``, built once at load): the K rows group by group, each group's run padded
to a multiple of 32 (act-order ``g_idx`` included, as ``rows_layout`` does for torch_int4pack), N
padded to a multiple of 32 with zero weights, nibbles in the AMX B-tile order (see the .cpp).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from halserve.platforms.cpu_kernels.panel import PanelKernel
from halserve.platforms.cpu_kernels.quant_gemm import AwqArgs, GptqArgs, rows_layout

BLOCK_K = 32  # rows per packed block (an AMX bf16 tile's depth)
PANEL_N = 32  # columns per panel (two 16-column tiles)


@dataclass(frozen=True, slots=True)
class NativeInt4Weight:
    """A 4-bit weight in the native kernel's layout (what ``prepare_weight`` returns)."""

    qpack: torch.Tensor  # [Np/16, Kp/32, 16, 16] uint8: nibbles in AMX B-tile order
    scales: torch.Tensor  # [G, Np] float32 (0 in padded columns)
    zeros: torch.Tensor  # [G, Np] float32: z, so w = (q - zeros) * scales
    block_group: torch.Tensor  # [Kp/32] int32: the group of each block of 32 rows
    src: torch.Tensor | None  # [Kp] int64: x column feeding each packed row (K: zero pad); None: identity
    k: int  # input features of x
    n: int  # output features


def repack_native(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> NativeInt4Weight:
    """``q [K, N]`` (0..15), ``zeros``/``scales [G, N]``, ``g_idx [K]`` -> the native layout of
    ``w[k, n] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n]``::

        packed row r of block kb, byte b: element b (low nibble) and b + 16 (high nibble), where
        element j of column tile t is column 16 t + j // 2, row 32 kb + 2 r + j % 2
    """
    k, n = q.shape
    src, block_group, _ = rows_layout(g_idx.long(), scales.shape[0], sizes=(BLOCK_K,))
    q = q.to(torch.uint8)
    if src is not None:
        q = torch.cat([q, torch.zeros(1, n, dtype=torch.uint8)]).index_select(0, src)  # [Kp, N]; row K: pad
    kp, np_ = q.shape[0], -(-n // PANEL_N) * PANEL_N
    pad = np_ - n
    s = torch.nn.functional.pad(scales.float(), (0, pad))  # [G, Np]: padded columns weigh 0
    z = torch.nn.functional.pad(zeros.float(), (0, pad))
    q = torch.nn.functional.pad(q, (0, pad))  # [Kp, Np]
    # [KB, r, pair, T, c] -> [T, KB, r, c, pair] = [T, KB, 16, 32 elements j = 2 c + pair]
    tiles = q.view(kp // BLOCK_K, 16, 2, np_ // 16, 16).permute(3, 0, 1, 4, 2).reshape(np_ // 16, kp // BLOCK_K, 16, 32)
    qpack = (tiles[..., :16] | (tiles[..., 16:] << 4)).contiguous()
    return NativeInt4Weight(qpack, s.contiguous(), z.contiguous(), block_group.to(torch.int32).contiguous(), src, k, n)


class _NativeInt4Gemm(PanelKernel):
    library = "int4"
    priority = 9  # above torch_int4pack (8); below IPEX's 4-bit kernels (10), which compute float32 exactly
    dtypes = ("float32", "float16", "bfloat16")
    prepared_type = NativeInt4Weight
    repack = staticmethod(repack_native)

    @classmethod
    def capabilities(cls) -> dict:
        return {"compute_dtype": "bfloat16", "isa": "AMX-BF16, else AVX512-BF16"}

    def run(self, x: torch.Tensor, w: NativeInt4Weight) -> torch.Tensor:
        if x.shape[-1] != w.k:
            raise ValueError(f"x has {x.shape[-1]} input features; the weight was prepared for K={w.k}")
        x2 = x.reshape(-1, w.k)  # [M, K]
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        out = torch.ops.halserve_cpu.int4_gemm(x2, w.qpack, w.scales, w.zeros, w.block_group, w.src, w.n,
                                               self.isa == "amx")
        return out.to(x.dtype).reshape(*x.shape[:-1], w.n)


class NativeInt4GptqGemm(GptqArgs, _NativeInt4Gemm):
    description = ("C++ 4-bit GEMM: bf16 panels dequantized into L2, AMX tiles (AVX512-BF16 without AMX); "
                   "act-order g_idx by a column gather of x per call")


class NativeInt4AwqGemm(AwqArgs, _NativeInt4Gemm):
    description = "C++ 4-bit GEMM: bf16 panels dequantized into L2, AMX tiles (AVX512-BF16 without AMX)"
