"""GGUF GEMM: out[M, N] = x[M, K] @ W[N, K].T (+ bias), W held as GGUF blocks (``halserve.kernels.gguf_blocks``).

Each program owns an output tile [BLOCK_M, BLOCK_N] and walks K in BLOCK_K steps; the weight tile
[BLOCK_K, BLOCK_N] is decoded from the stored bytes in registers, never in memory. The activations stay
float (no 8-bit rounding, unlike the CPU's native kernel): the result is the float reference's up to the
dot's input dtype (fp16/bf16 operands on a GPU, fp32 under the interpreter and for fp32 models).

Value k of row n lives in block ``k // B`` at byte ``n * row_bytes + (k // B) * S``; with ``j = k % B``:

    Q4_0  q = qs[2 + j % 16] >> 4 * (j // 16) & 0xF          w = d * (q - 8)            d = f16 @ 0
    Q4_1  q = qs[4 + j % 16] >> 4 * (j // 16) & 0xF          w = d * q + m              m = f16 @ 2
    Q8_0  q = int8 @ 2 + j                                    w = d * q
    Q4_K  s = j // 32 (sub-block), l = j % 32                 w = d * sc[s] * q - dmin * m[s]
          q = byte @ 16 + 32 * (s // 2) + l >> 4 * (s % 2) & 0xF      (d @ 0, dmin @ 2, 12 scale bytes @ 4)
    Q5_K  as Q4_K with qs @ 48, plus bit s of byte @ 16 + l as bit 4
    Q6_K  h = j // 128, t = j % 128 // 32, l = j % 32          w = d * int8 @ 192 + j // 16 * (q - 32)
          q = byte @ 64 h + 32 (t % 2) + l >> 4 (t // 2) & 0xF | (byte @ 128 + 32 h + l >> 2 t & 3) << 4   (d @ 208)

Every value finds its own block, so any BLOCK_K works with any type (a K tail is masked). The block fields
are read as bytes: blocks sit at 2-byte-aligned offsets only (18, 34, 210 bytes), and neighbouring values
of a tile read the same few bytes (cache hits, not memory traffic).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from halserve.platforms.triton_kernels.common import gemm_tiles, interpreting

# type name -> the kernel's QTYPE code (a constexpr: one compiled kernel per type)
QTYPE_CODES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5}


@triton.jit
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _half(ptr, mask):
    # two little-endian bytes -> float32 (a block's f16 field)
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequantize_tile(w_ptr, offs_k, offs_n, mask, stride_wn,
                     QTYPE: tl.constexpr, VALUES_PER_BLOCK: tl.constexpr, BYTES_PER_BLOCK: tl.constexpr):
    # -> float32 [BLOCK_K, BLOCK_N]: W[offs_n, offs_k].T
    j = (offs_k % VALUES_PER_BLOCK)[:, None]
    block = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + ((offs_k // VALUES_PER_BLOCK) * BYTES_PER_BLOCK)[:, None]
    if QTYPE == 0:  # Q4_0
        q = (_byte(block + 2 + j % 16, mask) >> (j // 16) * 4) & 0xF
        w = _half(block, mask) * (q - 8).to(tl.float32)
    elif QTYPE == 1:  # Q4_1
        q = (_byte(block + 4 + j % 16, mask) >> (j // 16) * 4) & 0xF
        w = _half(block, mask) * q.to(tl.float32) + _half(block + 2, mask)
    elif QTYPE == 2:  # Q8_0
        q = tl.load(block + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = _half(block, mask) * q.to(tl.float32)
    elif QTYPE == 3 or QTYPE == 4:  # Q4_K, Q5_K: 8 sub-blocks of 32, 6-bit scale and min each
        s = j // 32
        lane = j % 32
        if QTYPE == 3:
            q = (_byte(block + 16 + (s // 2) * 32 + lane, mask) >> (s % 2) * 4) & 0xF
        else:  # Q5_K: qs after the 32 qh bytes, bit s of qh[lane] is bit 4
            q = (_byte(block + 48 + (s // 2) * 32 + lane, mask) >> (s % 2) * 4) & 0xF
            q = q | (((_byte(block + 16 + lane, mask) >> s) & 1) << 4)
        # llama.cpp's get_scale_min_k4 over the 12 bytes at 4: sub-blocks 0-3 in the low 6 bits of bytes 0-7,
        # 4-7 from the nibbles of bytes 8-11 and the top 2 bits of bytes 0-7
        i = s % 4
        a = _byte(block + 4 + i, mask)
        b = _byte(block + 8 + i, mask)
        c = _byte(block + 12 + i, mask)
        low = s < 4
        sc = tl.where(low, a & 63, (c & 0xF) | ((a >> 6) << 4))
        mn = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
        w = _half(block, mask) * sc.to(tl.float32) * q.to(tl.float32) - _half(block + 2, mask) * mn.to(tl.float32)
    else:  # Q6_K: 16 sub-blocks of 16, int8 scales; 4 low bits in ql, 2 high bits in qh
        h = j // 128
        t = (j % 128) // 32
        lane = j % 32
        lo = (_byte(block + h * 64 + (t % 2) * 32 + lane, mask) >> (t // 2) * 4) & 0xF
        hi = (_byte(block + 128 + h * 32 + lane, mask) >> t * 2) & 3
        sc = tl.load(block + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = _half(block + 208, mask) * sc.to(tl.float32) * ((lo | (hi << 4)) - 32).to(tl.float32)
    return w


@triton.jit
def gguf_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om,
    QTYPE: tl.constexpr, VALUES_PER_BLOCK: tl.constexpr, BYTES_PER_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    # grouped ordering, as in the other GEMMs: neighbours share weight tiles in L2
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = _dequantize_tile(w_ptr, offs_k, offs_n, k_ok[:, None] & n_ok[None, :], stride_wn,
                             QTYPE, VALUES_PER_BLOCK, BYTES_PER_BLOCK)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gguf_gemm(x: torch.Tensor, qweight: torch.Tensor, qtype: str, bias: torch.Tensor | None = None,
              tiles: dict[str, int] | None = None) -> torch.Tensor:
    """``x [..., K]`` float, ``qweight uint8 [N, K / B * S]`` -> ``[..., N]`` in x's dtype. ``tiles`` overrides
    the tile choice (tests run the GPU tiles under the interpreter)."""
    from halserve.kernels.gguf_blocks import check_qtype, row_bytes

    block, size = check_qtype(qtype)
    k = x.shape[-1]
    n = qweight.shape[0]
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != row_bytes(qtype, k):
        raise ValueError(f"a {qtype} weight of {k} input features is uint8 [N, {row_bytes(qtype, k)}], got "
                         f"{qweight.dtype} {list(qweight.shape)}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if qweight.stride(1) != 1:
        qweight = qweight.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    if interpreting() or x.dtype == torch.float32:
        dot_dtype = tl.float32
    else:
        dot_dtype = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
    chosen = gemm_tiles(m, n, k)
    if not interpreting():
        # each weight value is decoded from its own byte loads, which the pipeliner holds in registers per
        # stage in flight (gathers cannot be staged in shared memory): 64-wide N tiles and 2 stages keep them
        # there (4 stages or 128-wide tiles spilled on sm_80 and gfx950, compile_check --sweep)
        chosen.update(BLOCK_N=64, num_stages=2)
        if chosen["BLOCK_M"] >= 64:  # 4 warps spilled at 64 x 64 fp16 (sm_90)
            chosen["num_warps"] = 8
        if chosen["BLOCK_M"] >= 128:  # Q6_K's decode beside a 128 x 64 accumulator spilled on sm_80 at 64 deep
            chosen["BLOCK_K"] = 32
        if x.dtype == torch.float32:  # FMA dots, both operands in registers (as the 4-bit GEMMs' fp32 path)
            chosen.update(BLOCK_M=16, BLOCK_K=32, num_warps=4, num_stages=3)
    chosen.update(tiles or {})
    grid = (triton.cdiv(m, chosen["BLOCK_M"]) * triton.cdiv(n, chosen["BLOCK_N"]),)
    gguf_gemm_kernel[grid](
        x2, qweight, bias if bias is not None else out, out,
        m, n, k,
        x2.stride(0), qweight.stride(0), out.stride(0),
        QTYPE=QTYPE_CODES[qtype], VALUES_PER_BLOCK=block, BYTES_PER_BLOCK=size,
        HAS_BIAS=bias is not None, DOT_DTYPE=dot_dtype, **chosen,
    )
    return out.reshape(*x.shape[:-1], n)
