"""4-bit weight-only GEMM: out[M, N] = x[M, K] @ dequant(W)[K, N], formats in ``halserve.kernels.packing``.

Each program owns an output tile [BLOCK_M, BLOCK_N] and walks K in BLOCK_K steps; the
weight tile [BLOCK_K, BLOCK_N] is unpacked and dequantized in registers, never in memory:

    AWQ   q[k, n] = qweight[k, n // 8] >> 4 * REV(n % 8) & 0xF,   REV(j) = j // 2 + 4 * (j % 2)
          z[g, n] = qzeros[g, n // 8]  >> 4 * REV(n % 8) & 0xF
    GPTQ  q[k, n] = qweight[k // 8, n] >> 4 * (k % 8) & 0xF
          z[g, n] = (qzeros[g, n // 8] >> 4 * (n % 8) & 0xF) + 1
    both  W[k, n] = (q - z[g(k), n]) * scales[g(k), n],   g(k) = g_idx[k] or k // G

Packed int32 words are loaded once each and unpacked to nibbles in registers (loading
them per nibble would stage 8x the bytes in shared memory: 268 KB per block at the GPU
tiles, over every NVIDIA part's limit). When BLOCK_K divides the group and there is no
g_idx, each K step needs one row of zeros and scales; otherwise (act-order g_idx) they are
gathered per row of the tile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from halserve.platforms.triton_kernels.common import gemm_tiles, interpreting


@triton.jit
def _unpack_cols(packed, shifts, ROWS: tl.constexpr, COLS: tl.constexpr):
    # [ROWS, COLS // 8] int32 -> [ROWS, COLS] nibbles, column c * 8 + j = packed[:, c] >> shifts[j]
    return tl.reshape((packed[:, :, None] >> shifts[None, None, :]) & 0xF, (ROWS, COLS))


@triton.jit
def wo4_gemm_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, out_ptr,
    M, N, K, group_size,
    stride_xm, stride_xk, stride_qw, stride_qz, stride_s, stride_om,
    IS_AWQ: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    ONE_GROUP_PER_BLOCK: tl.constexpr,  # no g_idx and BLOCK_K divides the group: one zero/scale row per K step
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    # grouped ordering, as in the scaled GEMM: neighbours share weight tiles in L2
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_pn = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)  # int32 columns packing N
    n_ok = offs_n < N
    pn_ok = offs_pn < N // 8
    j = tl.arange(0, 8)
    plain_shifts = j * 4  # GPTQ: nibble j of an int32 is element 8c + j
    if IS_AWQ:
        n_shifts = ((j // 2) + 4 * (j % 2)) * 4  # AutoAWQ interleave 0,2,4,6,1,3,5,7
    else:
        n_shifts = plain_shifts
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk,
                    mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
        # packed weights are loaded once per int32 (not once per nibble) and unpacked in registers
        if IS_AWQ:  # qweight [K, N // 8]
            packed = tl.load(qweight_ptr + offs_k[:, None] * stride_qw + offs_pn[None, :],
                             mask=k_ok[:, None] & pn_ok[None, :], other=0)
            q = _unpack_cols(packed, n_shifts, BLOCK_K, BLOCK_N)
        else:  # qweight [K // 8, N]: nibble j of row c is k = 8c + j
            offs_pk = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            packed = tl.load(qweight_ptr + offs_pk[:, None] * stride_qw + offs_n[None, :],
                             mask=(offs_pk < K // 8)[:, None] & n_ok[None, :], other=0)
            q = tl.reshape((packed[:, None, :] >> plain_shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        if ONE_GROUP_PER_BLOCK:  # zeros [N] and scales [N] of group k0 // G
            g0 = k0 // group_size
            zp = tl.load(qzeros_ptr + g0 * stride_qz + offs_pn, mask=pn_ok, other=0)
            z = _unpack_cols(zp[None, :], n_shifts, 1, BLOCK_N)  # [1, BLOCK_N]
            s = tl.load(scales_ptr + g0 * stride_s + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        else:  # a group per row of the tile (act-order g_idx, or groups smaller than BLOCK_K)
            if HAS_G_IDX:
                g = tl.load(g_idx_ptr + offs_k, mask=k_ok, other=0)
            else:
                g = offs_k // group_size
            zp = tl.load(qzeros_ptr + g[:, None] * stride_qz + offs_pn[None, :], mask=k_ok[:, None] & pn_ok[None, :],
                         other=0)
            z = _unpack_cols(zp, n_shifts, BLOCK_K, BLOCK_N)
            s = tl.load(scales_ptr + g[:, None] * stride_s + offs_n[None, :], mask=k_ok[:, None] & n_ok[None, :],
                        other=0.0).to(tl.float32)
        if not IS_AWQ:
            z = z + 1  # GPTQ v1 stores zero - 1
        w = (q - z).to(tl.float32) * s  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision="ieee")
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & n_ok[None, :])


def wo4_gemm(x, qweight, qzeros, scales, g_idx, group_size: int, *, is_awq: bool) -> torch.Tensor:
    m, k = x.shape
    n = scales.shape[1]
    group = k if group_size == -1 else group_size
    if k % group:
        raise ValueError(f"group_size {group_size} does not divide K={k}")
    if n % 8 or (not is_awq and k % 8):
        raise ValueError(f"4-bit packing needs N{'' if is_awq else ' and K'} to be multiples of 8, got N={n}, K={k}")
    expect = (k, n // 8) if is_awq else (k // 8, n)
    if tuple(qweight.shape) != expect:
        raise ValueError(f"qweight is {list(qweight.shape)}, expected {list(expect)} for x [{m}, {k}] and N={n}")
    # the kernel indexes the packed tensors with unit stride along their last dim
    qweight, qzeros, scales = qweight.contiguous(), qzeros.contiguous(), scales.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if interpreting() or x.dtype == torch.float32:
        dot_dtype = tl.float32
    else:
        dot_dtype = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
    tiles = gemm_tiles(m, n, k)
    if x.dtype == torch.float32 and not interpreting():
        # fp32 dots run on FMA units with both operands in registers: the tensor-core tiles
        # spilled 0.4-4 KB of registers and overflowed the shared memory of sm_89 and MI300
        # (compile_check --sweep); fp32 is a correctness path for these 16-bit-model kernels
        tiles.update(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3)
    tiles["BLOCK_K"] = min(tiles["BLOCK_K"], triton.next_power_of_2(group))  # groups of 32 keep one row per step
    grid = (triton.cdiv(m, tiles["BLOCK_M"]) * triton.cdiv(n, tiles["BLOCK_N"]),)
    wo4_gemm_kernel[grid](
        x, qweight, qzeros, scales, g_idx if g_idx is not None else qweight, out,
        m, n, k, group,
        x.stride(0), x.stride(1), qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0),
        IS_AWQ=is_awq, HAS_G_IDX=g_idx is not None,
        ONE_GROUP_PER_BLOCK=g_idx is None and group % tiles["BLOCK_K"] == 0,
        DOT_DTYPE=dot_dtype, **tiles,
    )
    return out
