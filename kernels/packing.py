"""4-bit weight packing of AutoAWQ (GEMM version) and GPTQ (v1), in plain torch.

Both formats quantize a linear weight ``W`` of logical shape ``[K, N]`` (input features
x output features, i.e. the transpose of ``nn.Linear.weight``) per group of ``G``
consecutive input rows::

    W[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n]        q, z in 0..15,  g(k) = k // G

(``G = K`` when a checkpoint says ``group_size = -1``: one group, per-channel scales.)
Eight 4-bit values share one int32; nibble ``i`` is bits ``4i .. 4i+3``. The int32s are
stored as torch.int32, so a nibble 7 in position 7 makes the value negative: unpack with
an arithmetic shift followed by ``& 0xF``.

AutoAWQ GEMM (``WQLinear_GEMM``)::

    qweight [K, N/8]    int32  packed along N
    qzeros  [K/G, N/8]  int32  packed along N, same order
    scales  [K/G, N]    fp16
    packed column c holds logical columns 8c .. 8c+7; nibble i holds column 8c + AWQ_ORDER[i]
    AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   so column 8c + j sits in nibble AWQ_REVERSE_ORDER[j]
    AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
    zeros are stored as they are.

GPTQ (AutoGPTQ / GPTQModel "v1" checkpoints)::

    qweight [K/8, N]    int32  packed along K: row r holds input rows 8r .. 8r+7, nibble i = row 8r + i
    qzeros  [K/G, N/8]  int32  packed along N: nibble i of column c = output column 8c + i
    scales  [K/G, N]    fp16
    g_idx   [K]         int32  group of each input row (optional; ``k // G`` when absent;
                               a permutation of that with act-order / desc_act)
    stored zero = (zero - 1) mod 16 and the unpacked zero is stored + 1 (range 1..16), so a
    zero of 0 cannot be represented in v1: ``pack_gptq`` rejects it.
"""
from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # bit offset of nibble i


def group_rows(k: int, group_size: int) -> int:
    """The effective group size: ``-1`` (per-channel) means one group of all ``k`` rows."""
    g = k if group_size == -1 else group_size
    if g <= 0 or k % g:
        raise ValueError(f"group_size {group_size} must be -1 or a positive divisor of K={k}")
    return g


def quantize_4bit(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest 4-bit quantization of ``w [K, N]`` per group of rows.

    Returns ``(q [K, N] int32 in 0..15, zeros [K/G, N] int32 in 1..15, scales [K/G, N] float32)``
    with ``w ~= (q - zeros) * scales``. Zeros are kept >= 1 so the result packs in both formats.
    """
    k, n = w.shape
    g = group_rows(k, group_size)
    wg = w.float().reshape(k // g, g, n)
    wmin = wg.amin(dim=1).clamp(max=0)
    wmax = wg.amax(dim=1).clamp(min=0)
    scales = ((wmax - wmin) / 14).clamp(min=1e-6)  # 14 steps: leaves room for zero >= 1
    zeros = (1 - torch.round(wmin / scales)).clamp(1, 15).to(torch.int32)
    q = torch.round(wg / scales[:, None]) + zeros[:, None]
    return q.clamp(0, 15).to(torch.int32).reshape(k, n), zeros, scales


def _pack_nibbles(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Pack groups of 8 consecutive 4-bit values along ``dim`` into int32 (nibble i = value i)."""
    v = values.to(torch.int32).movedim(dim, -1)
    if v.shape[-1] % 8:
        raise ValueError(f"dimension of size {v.shape[-1]} is not a multiple of 8")
    v = v.reshape(*v.shape[:-1], -1, 8) & 0xF
    packed = (v << _SHIFTS.to(v.device)).sum(dim=-1, dtype=torch.int64)  # < 2^32, no overlap
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # as int32 bits
    return packed.movedim(-1, dim).contiguous()


def _unpack_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of ``_pack_nibbles``: each int32 along ``dim`` becomes 8 values 0..15."""
    p = packed.movedim(dim, -1)
    v = (p.unsqueeze(-1) >> _SHIFTS.to(p.device)) & 0xF  # arithmetic shift, then mask
    return v.reshape(*p.shape[:-1], -1).movedim(-1, dim)


# -- AWQ ----------------------------------------------------------------------------------


def _awq_permute(x: torch.Tensor) -> torch.Tensor:
    # logical columns [.., 8c + j] -> storage order: nibble i takes column AWQ_ORDER[i]
    n = x.shape[-1]
    return x.reshape(*x.shape[:-1], n // 8, 8)[..., list(AWQ_ORDER)].reshape(x.shape)


def _awq_unpermute(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    return x.reshape(*x.shape[:-1], n // 8, 8)[..., list(AWQ_REVERSE_ORDER)].reshape(x.shape)


def pack_awq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, dtype=torch.float16):
    """``q [K, N]``, ``zeros [K/G, N]`` (0..15), ``scales [K/G, N]`` -> (qweight, qzeros, scales)."""
    qweight = _pack_nibbles(_awq_permute(q), dim=1)
    qzeros = _pack_nibbles(_awq_permute(zeros), dim=1)
    return qweight, qzeros, scales.to(dtype)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight [K, N/8], qzeros [K/G, N/8]) -> (q [K, N], zeros [K/G, N]) int32 in logical order."""
    return _awq_unpermute(_unpack_nibbles(qweight, 1)), _awq_unpermute(_unpack_nibbles(qzeros, 1))


def dequantize_awq(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """The float weight ``[K, N]`` (in ``scales.dtype``'s precision, returned as float32)."""
    q, zeros = unpack_awq(qweight, qzeros)
    g = group_rows(q.shape[0], group_size)
    return ((q - zeros.repeat_interleave(g, 0)) * scales.float().repeat_interleave(g, 0)).float()


# -- GPTQ ---------------------------------------------------------------------------------


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, dtype=torch.float16):
    """``q [K, N]``, ``zeros [K/G, N]`` (1..15), ``scales [K/G, N]`` -> (qweight, qzeros, scales)."""
    if torch.any(zeros < 1) or torch.any(zeros > 16):
        raise ValueError("GPTQ v1 stores zero - 1: zeros must be in 1..16")
    qweight = _pack_nibbles(q, dim=0)
    qzeros = _pack_nibbles((zeros - 1) & 0xF, dim=1)
    return qweight, qzeros, scales.to(dtype)


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight [K/8, N], qzeros [K/G, N/8]) -> (q [K, N], zeros [K/G, N]) with the +1 applied."""
    return _unpack_nibbles(qweight, 0), _unpack_nibbles(qzeros, 1) + 1


def dequantize_gptq(qweight, qzeros, scales, g_idx: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """The float weight ``[K, N]`` as float32; row k uses group ``g_idx[k]`` (or ``k // G``)."""
    q, zeros = unpack_gptq(qweight, qzeros)
    k = q.shape[0]
    if g_idx is None:
        g_idx = torch.arange(k, device=q.device) // group_rows(k, group_size)
    g_idx = g_idx.long()
    return ((q - zeros[g_idx]) * scales.float()[g_idx]).float()
