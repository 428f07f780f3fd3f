"""Triton fused MoE and GELU(tanh)-and-mul vs the torch references; how the cuda and rocm plugins resolve them.

In the interpreter (CPU) the tile sizes are fixed (BLOCK_M 16); the ``gpu`` tests add bf16 and
token counts that reach every GPU tile bucket of ``moe_tiles``.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from halserve.kernels.reference import TorchFusedMoe, TorchGeluTanhAndMul
from halserve.platforms.triton_kernels.activation import TritonGeluTanhAndMul
from halserve.platforms.triton_kernels.fused_moe import TritonFusedMoe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# the interpreter's numpy warns when exp overflows to inf in the saturating tail of a sigmoid
EXP_OVERFLOW = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


# -- gelu_tanh_and_mul ------------------------------------------------------------------------


@EXP_OVERFLOW
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,inter", [(3, 1500), (1, 64)])  # 1500: more than one 1024-wide block per row
def test_gelu_tanh_and_mul(dtype, rows, inter, device):
    x = (torch.randn(rows, 2 * inter) * 3).to(dtype)
    got = TritonGeluTanhAndMul()(x.to(device))
    want = TorchGeluTanhAndMul()(x)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, atol=TOL[dtype], rtol=TOL[dtype])


@EXP_OVERFLOW
def test_gelu_tanh_saturates_without_nan(device):
    # the sigmoid form meets exp overflow for large negative gates: it must give 0, not NaN
    gate = torch.tensor([-1e4, -60.0, -10.0, -1e-3, 0.0, 1e-3, 10.0, 60.0, 1e4])
    x = torch.cat([gate, torch.full_like(gate, 2.0)]).reshape(1, -1)
    got = TritonGeluTanhAndMul()(x.to(device)).cpu()
    want = TorchGeluTanhAndMul()(x)
    assert torch.isfinite(got).all(), got
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- fused_moe --------------------------------------------------------------------------------


def _moe_inputs(t: int, e: int, k: int, h: int, inter: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / math.sqrt(h)).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / math.sqrt(inter)).to(dtype)
    topk_weights, topk_ids = torch.rand(t, e, generator=g).softmax(-1).topk(k, dim=-1)
    return hidden, w13, w2, topk_weights, topk_ids


def _check_moe(inputs, device, dtype):
    got = TritonFusedMoe()(*[x.to(device) for x in inputs])
    want = TorchFusedMoe()(*inputs)
    assert got.dtype == dtype and got.shape == want.shape
    # two GEMMs and the activation in a row: twice the one-op tolerance, relative to max |ref|
    tol = 2 * TOL[dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol * want.float().abs().max().item(), rtol=tol)


@pytest.mark.parametrize(
    "dtype,t,e,k,h,inter",
    [
        (torch.float32, 1, 4, 2, 64, 64),  # decode: 2 of 4 experts idle
        (torch.float16, 1, 4, 1, 32, 16),  # decode, top-1: 3 idle experts
        (torch.float32, 7, 4, 2, 48, 40),  # T, H, I with tails: H and I not multiples of the 32-wide tiles
        (torch.float16, 9, 4, 3, 64, 48),
        (torch.float32, 5, 3, 3, 32, 24),  # top_k = E: every token visits every expert
    ],
)
def test_fused_moe(dtype, t, e, k, h, inter, device):
    _check_moe(_moe_inputs(t, e, k, h, inter, dtype), device, dtype)


def test_fused_moe_expert_runs_longer_than_a_tile(device):
    # 20 of 33 tokens on expert 0: its run spans two of the interpreter's BLOCK_M=16 tiles (the second padded),
    # expert 1 gets 13, experts 2 and 3 none; int32 ids, non-contiguous hidden
    hidden, w13, w2, _, _ = _moe_inputs(33, 4, 1, 32, 16, torch.float32)
    topk_ids = torch.tensor([0] * 20 + [1] * 13, dtype=torch.int32)[torch.randperm(33)].reshape(33, 1)
    topk_weights = torch.rand(33, 1) + 0.5
    wide = torch.randn(33, 64)
    wide[:, ::2] = hidden
    _check_moe((wide[:, ::2], w13, w2, topk_weights, topk_ids), device, torch.float32)


def test_fused_moe_no_tokens(device):
    hidden, w13, w2, tw, ti = _moe_inputs(0, 4, 2, 32, 16, torch.float16)
    out = TritonFusedMoe()(*[x.to(device) for x in (hidden, w13, w2, tw, ti)])
    assert out.shape == (0, 32) and out.dtype == torch.float16


def test_fused_moe_rejects_mismatched_shapes(device):
    hidden, w13, w2, tw, ti = _moe_inputs(3, 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match=r"w2 is \[4, 32, 8\]"):
        TritonFusedMoe()(hidden.to(device), w13.to(device), w2[..., :8].to(device), tw.to(device), ti.to(device))
    with pytest.raises(ValueError, match="must both be"):
        TritonFusedMoe()(hidden.to(device), w13.to(device), w2.to(device), tw[:2].to(device), ti.to(device))


def test_moe_align_pads_each_expert_run_to_the_tile():
    from halserve.platforms.triton_kernels.jit.fused_moe import moe_align

    topk_ids = torch.tensor([[3, 0], [0, 3], [3, 1], [3, 0], [0, 1]])  # expert 2 idle; P = 10 pairs
    block_m, num_pairs = 4, topk_ids.numel()
    sorted_pair_ids, block_expert_ids, num_padded = moe_align(topk_ids, 4, block_m)
    counts = torch.bincount(topk_ids.reshape(-1), minlength=4)  # [4, 2, 0, 4]
    assert num_padded.item() == sum(-(-int(c) // block_m) * block_m for c in counts)  # 4 + 4 + 0 + 4
    assert sorted_pair_ids.numel() >= num_padded.item() and sorted_pair_ids.numel() % block_m == 0
    used = sorted_pair_ids[: num_padded.item()].reshape(-1, block_m)
    real = used[used < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    assert (sorted_pair_ids[num_padded.item():] == num_pairs).all()
    flat = topk_ids.reshape(-1)
    for block, expert in zip(used, block_expert_ids[: used.shape[0]].tolist()):
        pairs = block[block < num_pairs]
        assert pairs.numel() and (flat[pairs] == expert).all()  # one expert per tile, no empty tile
    assert 2 not in block_expert_ids[: used.shape[0]].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t", [1, 37, 300, 1100])  # every tile bucket of moe_tiles (rows per expert 0.25 .. 275)
def test_fused_moe_gpu_tiles(dtype, t, device):
    _check_moe(_moe_inputs(t, 8, 2, 256, 320, dtype, seed=t), device, dtype)


@pytest.mark.gpu
def test_fused_moe_and_gelu_bf16_gpu(device):
    # bf16 is for GPUs only: the interpreter computes bf16 arithmetic on the raw bit patterns
    _check_moe(_moe_inputs(9, 4, 2, 64, 48, torch.bfloat16), device, torch.bfloat16)
    x = (torch.randn(8, 2 * 4096) * 3).to(torch.bfloat16)
    torch.testing.assert_close(TritonGeluTanhAndMul()(x.to(device)).cpu(), TorchGeluTanhAndMul()(x), atol=2e-2,
                               rtol=2e-2)


# -- registration and the benchmark -----------------------------------------------------------


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_plugins_resolve_the_new_ops_to_triton(platform):
    proc = subprocess.run([sys.executable, "-m", "halserve.entrypoints.cli", "plugins", "--json", "--platform",
                           platform], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = json.loads(proc.stdout)["resolved_kernels"]
    for op in ("fused_moe", "gelu_tanh_and_mul", "silu_and_mul"):
        assert resolved[op] == f"triton_{platform}", (op, resolved[op])


def test_fused_moe_benchmark_tiny_runs():
    path = os.path.join(ROOT, "benchmarks", "kernels", "bench_fused_moe.py")
    result = subprocess.run([sys.executable, path, "--tiny", "--no-reference"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TFLOP/s" in result.stdout and "GB/s" in result.stdout and "max err" in result.stdout
