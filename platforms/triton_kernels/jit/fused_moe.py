"""Fused mixture-of-experts MLP: sort the (token, slot) pairs by expert, then two grouped GEMMs.

    hidden [T, H], topk_ids / topk_weights [T, k]: P = T * k pairs, pair p = t * k + j

1. align (torch, on the device, no host sync): pairs sorted by expert, each expert's run
   padded to a multiple of BLOCK_M with a sentinel pair id P, so every BLOCK_M rows of
   ``sorted_pair_ids`` belong to one expert (``block_expert_ids``):

       sorted_pair_ids  | e0 e0 e0 P | e2 e2 e2 e2 | e2 P P P | e3 P P P | (unused ...)
       block_expert_ids |     0      |      2      |    2     |    3     |

   Idle experts get no block. The grid covers the most blocks any routing can need,
   P + min(E, P) * (BLOCK_M - 1) rows, so it is fixed by the shapes (no ``.item()``: nothing
   waits on the GPU, as CUDA graphs need); blocks past the real total (``num_padded``) return
   at once.
2. ``moe_gemm_kernel``, GATED: inter[p] = silu(x[t] @ gate[e].T) * (x[t] @ up[e].T), with both
   halves of w13 in one program (two accumulators), so the [P, 2I] pre-activation never
   reaches memory.
3. ``moe_gemm_kernel``: y[p] = topk_weights[p] * inter[p] @ w2[e].T, in fp32.
4. out[t] = sum over j of y[t * k + j] (torch), rounded once to the activation dtype.

Products accumulate in fp32. silu(gate) * up is computed from the fp32 accumulators and rounded
to the model dtype once, before the second GEMM (the torch reference rounds gate and up first,
a difference well inside the op's tolerances).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from halserve.platforms.triton_kernels.common import interpreting
from halserve.platforms.triton_kernels.jit.scaled_gemm import _swizzle


@triton.jit
def moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, topk_weights_ptr,
    sorted_pair_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
    N, K, num_pairs, max_padded,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    A_ROW_DIV: tl.constexpr,  # a row of the pair: p // top_k (hidden, by token) or p (inter, by pair)
    GATED: tl.constexpr,  # w rows [0, N) gate and [N, 2N) up: out = silu(a @ gate.T) * (a @ up.T)
    MUL_ROUTING_WEIGHT: tl.constexpr,  # out *= topk_weights[p]
    DOT_DTYPE: tl.constexpr,  # operands of tl.dot: the activation dtype, fp32 under the interpreter
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _swizzle(tl.program_id(0), max_padded, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # a block past the padded runs of this routing
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + offs_m)  # [BM], the sentinel num_pairs on padding rows
    row_ok = pairs < num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BM, BK]
    # [BK, BN] = the transposed tile of w[e] ([N, K] rows, nn.Linear layout)
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # input_precision "ieee": fp32 operands are not rounded to tf32 (16-bit ones are unaffected)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(DOT_DTYPE)
        acc = tl.dot(a, w, acc, input_precision="ieee")
        if GATED:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(DOT_DTYPE)
            acc_up = tl.dot(a, w_up, acc_up, input_precision="ieee")
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_ROUTING_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    o_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Pairs sorted by expert, each expert's run padded to a multiple of ``block_m``.

    Returns (sorted_pair_ids [max_padded] int32 (pad rows hold P), block_expert_ids
    [max_padded / block_m] int32, num_padded [1] int32: the rows the runs really use).
    Device-side torch ops only: nothing waits for the GPU.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)  # [P] expert of each pair
    num_pairs = flat.numel()
    # scatter_add_, not bincount: bincount sizes its output from the data (a host sync)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = padded.cumsum(0)  # [E] inclusive end row of each expert's run
    order = torch.argsort(flat, stable=True)  # [P] pair ids, grouped by expert
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]  # place in its run
    dest = (padded_end - padded)[sorted_experts] + rank
    max_padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    max_padded = triton.cdiv(max_padded, block_m) * block_m
    sorted_pair_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    # the expert whose run holds each block's first row; blocks past the end are clamped (never read)
    block_expert_ids = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pair_ids, block_expert_ids.to(torch.int32), padded_end[-1:].to(torch.int32)


def moe_tiles(rows_per_expert: float, dtype: torch.dtype) -> dict[str, int]:
    """Tiles of both GEMMs by the average rows an expert gets (T * k / E). Fixed per problem
    size: the interpreter cannot autotune, and a GPU launch must not wait on a benchmark.

    16-bit, loosely after vLLM's H100 tuning for Mixtral: BLOCK_M 16 while experts see a handful of
    rows (decode: the GEMMs stream weights, and small tiles give enough programs to stream
    from every SM), growing to 128 for prefill; GATED launches halve BLOCK_N (two weight tiles
    and two accumulators). fp32 takes the FMA tiles of the 4-bit GEMMs (operands held in
    registers). ``num_stages`` is fitted to the GPU's shared memory in ``_fit_stages``.
    """
    if interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}
    if dtype == torch.float32:
        return {"BLOCK_M": 16 if rows_per_expert <= 16 else 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 4,
                "num_warps": 4}
    if rows_per_expert <= 8:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4}
    if rows_per_expert <= 24:
        return {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 4, "num_warps": 4}
    if rows_per_expert <= 128:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8}


@functools.cache
def _target(driver_id: int, device: int) -> tuple[str, int]:
    # once per (driver, device), not per launch: (backend, bytes of shared memory / LDS per block)
    driver = triton.runtime.driver.active
    return driver.get_current_target().backend, driver.utils.get_device_properties(device)["max_shared_mem"]


def _fit_stages(tiles: dict[str, int], gated: bool, elem_bytes: int) -> dict[str, int]:
    """``num_stages`` for the active GPU. NVIDIA: up to 4, as many as ``num_stages`` A + W tiles
    fit its shared memory (Triton buffers num_stages - 1 of them; the rest is slack for the
    epilogue's layout conversions): H100 (227 KB) and A100 (163 KB) keep 4, sm_89 (99 KB) 3
    for the 128-row prefill tiles. AMD: 2, the stream pipeliner's setting (one LDS buffer;
    MI300 has 64 KB), with BLOCK_K halved should two stages' tiles not fit."""
    driver = triton.runtime.driver.active
    backend, max_shared = _target(id(driver), driver.get_current_device())
    tiles = dict(tiles)

    def stage_bytes() -> int:  # one A tile and one (two when gated) W tiles
        return (tiles["BLOCK_M"] + (2 if gated else 1) * tiles["BLOCK_N"]) * tiles["BLOCK_K"] * elem_bytes

    if backend == "hip":
        while 2 * stage_bytes() > max_shared and tiles["BLOCK_K"] > 16:
            tiles["BLOCK_K"] //= 2
        tiles["num_stages"] = 2
    else:
        tiles["num_stages"] = max(2, min(4, max_shared // stage_bytes()))
    return tiles


def _launch(a, w, out, topk_weights, align, *, n: int, k: int, num_pairs: int, a_row_div: int, gated: bool,
            mul_routing_weight: bool, tiles: dict[str, int]) -> None:
    sorted_pair_ids, block_expert_ids, num_padded = align
    max_padded = sorted_pair_ids.numel()
    if gated and not interpreting():
        tiles = {**tiles, "BLOCK_N": tiles["BLOCK_N"] // 2}  # two weight tiles per program
    if not interpreting():
        tiles = _fit_stages(tiles, gated, a.element_size())
    if interpreting() or a.dtype == torch.float32:
        dot_dtype = tl.float32  # (the interpreter mis-multiplies bf16 operands; fp32 is exact for all three)
    else:
        dot_dtype = tl.bfloat16 if a.dtype == torch.bfloat16 else tl.float16
    grid = ((max_padded // tiles["BLOCK_M"]) * triton.cdiv(n, tiles["BLOCK_N"]),)
    moe_gemm_kernel[grid](
        a, w, out, topk_weights, sorted_pair_ids, block_expert_ids, num_padded,
        n, k, num_pairs, max_padded,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        A_ROW_DIV=a_row_div, GATED=gated, MUL_ROUTING_WEIGHT=mul_routing_weight, DOT_DTYPE=dot_dtype, **tiles,
    )


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[-1]
    if tuple(w13.shape) != (num_experts, 2 * inter, hidden_size) or two_inter % 2:
        raise ValueError(f"w13 is {list(w13.shape)}; expected [E, 2I, H] with H={hidden_size} (hidden is "
                         f"{list(hidden.shape)})")
    if tuple(w2.shape) != (num_experts, hidden_size, inter):
        raise ValueError(f"w2 is {list(w2.shape)}; expected [E, H, I] = [{num_experts}, {hidden_size}, {inter}]")
    if tuple(topk_ids.shape) != (num_tokens, top_k) or tuple(topk_weights.shape) != (num_tokens, top_k):
        raise ValueError(f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must both be "
                         f"[T, k] with T={num_tokens}")
    if not hidden.dtype == w13.dtype == w2.dtype:
        raise ValueError(f"hidden, w13 and w2 must share one dtype, got {hidden.dtype}, {w13.dtype}, {w2.dtype}")
    if num_tokens == 0:
        return torch.empty_like(hidden)
    num_pairs = num_tokens * top_k
    tiles = moe_tiles(num_pairs / num_experts, hidden.dtype)
    align = moe_align(topk_ids, num_experts, tiles["BLOCK_M"])
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [P], pair p = t * k + j
    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)  # [P, I] silu(gate) * up
    _launch(hidden, w13, act, weights, align, n=inter, k=hidden_size, num_pairs=num_pairs, a_row_div=top_k,
            gated=True, mul_routing_weight=False, tiles=tiles)
    # fp32 per-pair outputs, summed over the k slots in fp32 and rounded once, as the reference does
    y = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)  # [P, H]
    _launch(act, w2, y, weights, align, n=hidden_size, k=inter, num_pairs=num_pairs, a_row_div=1, gated=False,
            mul_routing_weight=True, tiles=tiles)
    return y.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
