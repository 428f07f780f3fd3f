"""GGUF (ggml) quantization blocks in torch: sizes, dequantizers, and the activation quantizer of the
native CPU kernels. The dequantizers are the definition of correct for ``gguf_gemm`` (checked against
the ``gguf`` package's ``gguf.quants.dequantize`` in tests/kernels/test_gguf_blocks.py).

A quantized weight ``[N, K]`` is stored as GGUF stores it: ``uint8 [N, K / B * S]``, each row K / B
blocks of S bytes for B values (llama.cpp's ``block_q4_0`` ... ``block_q6_K``, little-endian)::

    Q4_0  B=32   S=18   d f16 | qs[16]                      w = d * (q - 8)      q: nibbles, low = 0..15
    Q4_1  B=32   S=20   d f16 | m f16 | qs[16]              w = d * q + m        high = 16..31
    Q8_0  B=32   S=34   d f16 | qs int8[32]                 w = d * q
    Q4_K  B=256  S=144  d, dmin f16 | scales[12] | qs[128]  w = d * sc_j * q - dmin * m_j   (8 x 32, 6-bit sc/m)
    Q5_K  B=256  S=176  d, dmin f16 | scales[12] | qh[32] | qs[128]  as Q4_K with a 5th bit from qh
    Q6_K  B=256  S=210  ql[128] | qh[64] | scales int8[16] | d f16   w = d * sc_j * (q - 32)  (16 x 16)
"""
from __future__ import annotations

import torch

# type name -> (values per block B, bytes per block S)
GGUF_BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
QUANTIZED_TYPES = tuple(GGUF_BLOCKS)


def check_qtype(qtype: str) -> tuple[int, int]:
    """(B, S) of ``qtype``; an unknown type is a ``ValueError`` listing the supported ones."""
    try:
        return GGUF_BLOCKS[qtype]
    except KeyError:
        raise ValueError(f"GGUF type {qtype!r} has no quantized kernel in halserve; supported: "
                         f"{', '.join(QUANTIZED_TYPES)} (others load dequantized with --quantization unquantized)"
                         ) from None


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one stored row of ``k`` values; ``k`` must be a whole number of blocks."""
    block, size = check_qtype(qtype)
    if k % block:
        raise ValueError(f"GGUF type {qtype} packs {block} values per block, but a row has {k} values "
                         f"(not a multiple of {block})")
    return k // block * size


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` uint8 (little-endian half) -> ``[...]`` float32."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., 16]`` uint8 -> ``[..., 32]``: the low nibbles (values 0..15), then the high ones (16..31)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 packed bytes ``[..., 12]`` -> 8 six-bit scales and 8 mins, ``[..., 8]`` each
    (llama.cpp's ``get_scale_min_k4``)."""
    s = scales.to(torch.int32)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1).float(), torch.cat([lo_m, hi_m], -1).float()


def dequantize(qweight: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """``uint8 [N, K / B * S]`` blocks of ``qtype`` -> ``float32 [N, K]``."""
    block, size = check_qtype(qtype)
    n = qweight.shape[0]
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != row_bytes(qtype, k):
        raise ValueError(f"a {qtype} weight of {k} input features is uint8 [N, {row_bytes(qtype, k)}], got "
                         f"{qweight.dtype} {list(qweight.shape)}")
    b = qweight.reshape(n, k // block, size)  # [N, blocks, S]
    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
        d = _f16(b[..., 0:2])[..., None]  # [N, blocks, 1]
        if qtype == "Q8_0":
            w = d * b[..., 2:].view(torch.int8).float()
        elif qtype == "Q4_0":
            w = d * (_nibbles(b[..., 2:]).float() - 8)
        else:
            w = d * _nibbles(b[..., 4:]).float() + _f16(b[..., 2:4])[..., None]
    elif qtype in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
        sc, m = _scale_min_k4(b[..., 4:16])  # [N, blocks, 8]
        qs = b[..., -128:].reshape(n, -1, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2j (low), 2j + 1 (high)
        q = torch.stack([qs & 0xF, qs >> 4], dim=3).reshape(n, -1, 8, 32).to(torch.int32)
        if qtype == "Q5_K":
            qh = b[..., 16:48].to(torch.int32)  # bit j of qh[l] is the 5th bit of sub-block j's value l
            bits = torch.arange(8, device=qweight.device, dtype=torch.int32)
            q = q + (((qh[..., None, :] >> bits[:, None]) & 1) << 4)
        w = (d * sc)[..., None] * q.float() - (dmin * m)[..., None]
    else:  # Q6_K
        ql, qh = b[..., 0:128].to(torch.int32), b[..., 128:192].to(torch.int32)
        sc = b[..., 192:208].view(torch.int8).float()  # [N, blocks, 16]
        d = _f16(b[..., 208:210])[..., None]
        ql = ql.reshape(n, -1, 2, 2, 32)  # [half, l or l + 32, l]
        qh = qh.reshape(n, -1, 2, 1, 32)
        lo, hi = ql & 0xF, ql >> 4  # values l, l + 32 of each half (lo); l + 64, l + 96 (hi)
        q = torch.stack([
            lo[..., 0, :] | ((qh[..., 0, :] >> 0) & 3) << 4,
            lo[..., 1, :] | ((qh[..., 0, :] >> 2) & 3) << 4,
            hi[..., 0, :] | ((qh[..., 0, :] >> 4) & 3) << 4,
            hi[..., 1, :] | ((qh[..., 0, :] >> 6) & 3) << 4,
        ], dim=3) - 32  # [N, blocks, half, 4, 32]
        q = q.reshape(n, -1, 16, 16).float()  # 16 sub-blocks of 16 values
        w = (d * sc)[..., None] * q
    return w.reshape(n, k)


def quantize_activations_q8(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """What the native kernels do to the activations: per row and block of 32, ``d = amax / 127`` and
    ``q = round(x / d)`` (llama.cpp's ``quantize_row_q8_0``/``q8_1``). ``x [M, K]`` -> (``q`` int8
    ``[M, K]``, ``d`` float32 ``[M, K / 32]``); the kernels compute ``sum_k (d q)[m, k] w[n, k]`` exactly in
    integers per block, so this is their reference up to float summation order."""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    d = xb.abs().amax(-1) / 127.0  # [M, blocks]
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(m, k), d


TWO_LEVEL_RATIO = 255  # the second int8 level's scale is the first's / 255 (gguf_gemm.cpp's kTwoLevelRatio)


def two_level_activations(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the native kernels do to the activations at two int8 levels: the first level as
    ``quantize_activations_q8``, then its rounding error r = x - d q at the fixed scale d2 = d / 255 (q2 = round(r /
    d2) clamped to +-127: |r| <= d / 2 keeps it within 1/2 of r / d2). ``x [M, K]`` -> (the first level as floats
    ``d q``, the second ``d2 q2``, ``d2`` per value), all float32 ``[M, K]``; x = d q + d2 q2 to within d2 / 2."""
    m, k = x.shape
    q, d = quantize_activations_q8(x, block)
    d = d.repeat_interleave(block, dim=1)
    x1 = q.float() * d
    d2 = d / TWO_LEVEL_RATIO
    inv = torch.where(d2 > 0, 1.0 / d2, torch.zeros_like(d2))
    q2 = torch.round((x.float() - x1) * inv).clamp(-127, 127)
    return x1, q2 * d2, d2


# the size of one stored value q times its scale fields, so random blocks give weights of about 1 / sqrt(K)
_SCALE_OF = {"Q4_0": 1 / 8, "Q4_1": 1 / 8, "Q8_0": 1 / 128, "Q4_K": 1 / 512, "Q5_K": 1 / 1024, "Q6_K": 1 / 4096}


def random_blocks(qtype: str, n: int, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Valid random blocks ``uint8 [n, row bytes]`` of ``qtype`` (tests, conformance): random bytes with the
    float16 scale fields overwritten by finite ones (Q4_1's minimum about -8 d, so weights centre near 0)."""
    block, size = check_qtype(qtype)
    blocks = n * (k // block)
    raw = torch.randint(0, 256, (blocks, size), dtype=torch.uint8, generator=generator)
    d = _SCALE_OF[qtype] / k ** 0.5 * (0.5 + torch.rand(blocks, generator=generator))

    def put(offset: int, values: torch.Tensor) -> None:
        raw[:, offset:offset + 2] = values.to(torch.float16).view(torch.uint8).reshape(blocks, 2)

    if qtype == "Q6_K":
        put(208, d)
    else:
        put(0, d)
        if qtype == "Q4_1":
            put(2, -8 * d)
        elif qtype in ("Q4_K", "Q5_K"):
            put(2, d)
    return raw.reshape(n, row_bytes(qtype, k))
