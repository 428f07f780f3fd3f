"""Block-wise fp8 (DeepSeek-V3 / Qwen3-FP8): the torch references against an explicit
block-by-block dequantization, then the Triton kernels against the references."""
from __future__ import annotations

import math

import pytest
import torch

from halserve.kernels.reference import TorchFp8BlockScaledGemm, TorchPerTokenGroupFp8Quant
from halserve.platforms import cuda, rocm
from halserve.platforms.triton_kernels.fp8_block_gemm import TritonFp8BlockScaledGemm, TritonPerTokenGroupFp8Quant


def _operands(m, n, k, block_size, fp8=torch.float8_e4m3fn, seed=0):
    """Random fp8 a [M, K], b [N, K] with scales [M, ceil(K/Bk)], [ceil(N/Bn), ceil(K/Bk)] and a bias."""
    block_n, block_k = block_size
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 4).to(fp8)
    b = (torch.randn(n, k, generator=g) * 4).to(fp8)
    scale_a = torch.rand(m, math.ceil(k / block_k), generator=g) + 0.5
    scale_b = torch.rand(math.ceil(n / block_n), math.ceil(k / block_k), generator=g) + 0.5
    bias = torch.randn(n, generator=g)
    return a, b, scale_a, scale_b, bias


def _dequantize_blocks(q, scale, block_rows, block_cols):
    """q [R, C] * the scale of each block_rows x block_cols block, one block at a time."""
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block_rows, (i + 1) * block_rows), slice(j * block_cols, (j + 1) * block_cols)
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


# -- the references ------------------------------------------------------------------------
@pytest.mark.parametrize("m,n,k,block_size", [(3, 256, 384, (128, 128)), (4, 200, 300, (128, 128)),
                                              (2, 40, 72, (16, 32))])
def test_reference_gemm_is_blockwise_dequantize_then_matmul(m, n, k, block_size):
    a, b, scale_a, scale_b, bias = _operands(m, n, k, block_size)
    x = _dequantize_blocks(a, scale_a, 1, block_size[1])  # [M, K], one scale per token per Bk group
    w = _dequantize_blocks(b, scale_b, *block_size)  # [N, K]
    want = x @ w.T + bias
    got = TorchFp8BlockScaledGemm()(a, b, scale_a, scale_b, block_size, torch.float32, bias)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert TorchFp8BlockScaledGemm()(a, b, scale_a, scale_b, list(block_size), torch.float16).dtype == torch.float16


def test_reference_group_quant_scales_each_group_by_its_amax():
    x = torch.randn(3, 200) * 2
    x[1, 128:] = 0.0  # an all-zero group: scale clamped away from 0, q all zeros
    q, scale = TorchPerTokenGroupFp8Quant()(x, "float8_e4m3fn", 128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (3, 200) and scale.shape == (3, 2)
    for row in range(3):
        for group, cols in enumerate((slice(0, 128), slice(128, 200))):
            want_scale = max(x[row, cols].abs().max().item() / 448.0, 1e-12)
            assert scale[row, group].item() == pytest.approx(want_scale, rel=1e-6)
            torch.testing.assert_close(q[row, cols].float(), (x[row, cols] / scale[row, group]).to(q.dtype).float())
    assert scale[1, 1].item() == pytest.approx(1e-12) and not q[1, 128:].float().any()
    # the group's largest magnitude lands on the fp8 max; dequantizing is within fp8's 3 mantissa bits
    assert q.float().abs().amax(dim=1).tolist() == [448.0] * 3
    deq = q.float() * scale.repeat_interleave(128, dim=1)[:, :200]
    torch.testing.assert_close(deq, x, atol=0, rtol=2 ** -4)


def test_reference_rejects_mismatched_scales():
    a, b, scale_a, scale_b, _ = _operands(2, 40, 72, (16, 32))
    with pytest.raises(ValueError, match=r"scale_b is \[3, 3\], expected \[ceil\(N/32\), ceil\(K/32\)\] = \[2, 3\]"):
        TorchFp8BlockScaledGemm()(a, b, scale_a, scale_b, (32, 32), torch.float32)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        TorchPerTokenGroupFp8Quant()(torch.zeros(2, 8), "float8_e4m3fn", 0)


# -- the Triton kernels (interpreted on CPU, compiled on a GPU) ------------------------------
@pytest.mark.parametrize(
    "fp8,m,n,k,block_size,out_dtype,upcast",
    [
        (torch.float8_e4m3fn, 5, 48, 80, (32, 32), torch.float32, False),  # K, N and M tails
        (torch.float8_e4m3fn, 3, 40, 72, (16, 64), torch.float16, False),  # Bn < the N tile, Bk > the K tile
        (torch.float8_e4m3fn, 2, 136, 200, (128, 128), torch.float32, False),  # the checkpoints' blocks
        (torch.float8_e4m3fn, 4, 24, 48, (8, 16), torch.float32, False),  # Bk below the K tile
        (torch.float8_e5m2, 5, 48, 80, (32, 32), torch.float16, False),
        (torch.float8_e4m3fn, 5, 48, 80, (32, 32), torch.float16, True),  # the fp16-upcast path of pre-sm89 GPUs
        (torch.float8_e4m3fnuz, 3, 40, 72, (16, 64), torch.float32, True),  # pre-MI300 AMD GPUs, ROCm's flavour
    ],
)
def test_fp8_block_gemm(fp8, m, n, k, block_size, out_dtype, upcast, device):
    a, b, sa, sb, bias = _operands(m, n, k, block_size, fp8)
    got = TritonFp8BlockScaledGemm(upcast=upcast)(*(t.to(device) for t in (a, b, sa, sb)), block_size, out_dtype,
                                                  bias.to(device))
    want = TorchFp8BlockScaledGemm()(a, b, sa, sb, block_size, out_dtype, bias)
    assert got.dtype == out_dtype and got.shape == (m, n)
    tol = 1e-4 if out_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol)


def test_fp8_block_gemm_strided_scales_and_no_bias(device):
    # scales transposed in memory (e.g. a loader that keeps K-major scales): strides are honoured
    a, b, sa, sb, _ = _operands(5, 48, 80, (32, 32))
    sa_t, sb_t = sa.T.contiguous().T, sb.T.contiguous().T
    got = TritonFp8BlockScaledGemm()(a.to(device), b.to(device), sa_t.to(device), sb_t.to(device), (32, 32),
                                     torch.float32)
    want = TorchFp8BlockScaledGemm()(a, b, sa, sb, (32, 32), torch.float32)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)
    empty = TritonFp8BlockScaledGemm()(a[:0].to(device), b.to(device), sa[:0].to(device), sb.to(device), (32, 32),
                                       torch.float32)
    assert empty.shape == (0, 48)


@pytest.mark.parametrize("dtype,group_size,k", [(torch.float32, 128, 300), (torch.float16, 64, 200),
                                                (torch.float32, 48, 100)])  # K tails; a group that is no power of 2
def test_per_token_group_quant(dtype, group_size, k, device):
    x = (torch.randn(5, k) * 2).to(dtype)
    x[2, :group_size] = 0.0
    q, s = TritonPerTokenGroupFp8Quant()(x.to(device), "float8_e4m3fn", group_size)
    q_ref, s_ref = TorchPerTokenGroupFp8Quant()(x, "float8_e4m3fn", group_size)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (5, math.ceil(k / group_size))
    torch.testing.assert_close(s.cpu(), s_ref)
    # as test_scaled_fp8_quant: the interpreter's fp32->fp8 casts are inexact on a few % of
    # values (triton#8322): a dropped rounding carry (up to 2x too small) or a one-ulp miss
    exact = q.cpu().float() == q_ref.float()
    assert exact.float().mean() > 0.9
    ratio = q.cpu().float()[~exact] / q_ref.float()[~exact]
    assert torch.all((ratio >= 0.5) & (ratio <= 1.0 + 1 / 8 + 1e-6)), ratio


def test_quantized_linear_matches_fp32(device):
    # a whole fp8 linear layer: weights quantized per 128x128 block (as stored in the
    # checkpoint), activations per token per 128 features by the kernel, then the block GEMM
    m, n, k, block = 3, 136, 200, 128
    x, w = torch.randn(m, k), torch.randn(n, k) * 0.05
    w_blocks = torch.nn.functional.pad(w, (0, 56, 0, 120)).reshape(2, block, 2, block)  # [N/Bn, Bn, K/Bk, Bk]
    w_scale = (w_blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)  # [ceil(N/Bn), ceil(K/Bk)]
    w_q = (w_blocks / w_scale[:, None, :, None]).reshape(2 * block, 2 * block)[:n, :k].to(torch.float8_e4m3fn)
    x_q, x_scale = TritonPerTokenGroupFp8Quant()(x.to(device), "float8_e4m3fn", block)
    got = TritonFp8BlockScaledGemm()(x_q, w_q.to(device), x_scale, w_scale.to(device), (block, block),
                                     torch.float32).cpu()
    want = TorchFp8BlockScaledGemm()(x_q.cpu(), w_q, x_scale.cpu(), w_scale, (block, block), torch.float32)
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)
    # fp8 keeps 3 mantissa bits: ~3% per product, averaging out over K (the interpreter's
    # inexact casts add a little); a wrong scale would be off by far more
    exact = x @ w.T
    torch.testing.assert_close(got, exact, atol=0.1 * exact.abs().max().item(), rtol=0)


def test_supports_reasons():
    gemm = TritonFp8BlockScaledGemm
    assert gemm.supports(dtype="float8_e4m3fn", n=4096, k=7168, block_size=(128, 128),
                         fp8_dtype="float8_e4m3fn") is None
    assert "power of two" in gemm.supports(dtype="float8_e4m3fn", n=64, k=64, block_size=(128, 96))
    assert "power of two" in gemm.supports(dtype="float8_e4m3fn", n=64, k=64, block_size=(128, 8))
    assert "fp8 dtype" in gemm.supports(dtype="float8_e4m3fn", n=64, k=64, block_size=(128, 128),
                                        fp8_dtype="int8")
    assert "group size 0" in TritonPerTokenGroupFp8Quant.supports(dtype="float16", fp8_dtype="float8_e4m3fn",
                                                                  group_size=0)


def test_registered_for_cuda_and_rocm():
    for plugin, platform, fp8 in ((cuda, "cuda", "float8_e4m3fn"), (rocm, "rocm", "float8_e4m3fnuz")):
        kernels = {(k.op, k.name): k for k in plugin.halserve_kernels()}
        gemm = kernels[("fp8_block_scaled_gemm", f"triton_{platform}")]
        quant = kernels[("per_token_group_fp8_quant", f"triton_{platform}")]
        assert gemm.platforms == quant.platforms == (platform,)
        assert gemm.dtypes[0] == fp8 and fp8 in quant.fp8_dtypes
        assert gemm.supports(dtype=fp8, n=4096, k=7168, block_size=(128, 128), fp8_dtype=fp8) is None


# -- compiled only: bf16 outputs, GPU tiles, the platform's fp8 -----------------------------
def _gpu_fp8() -> torch.dtype:
    if torch.version.hip:
        return getattr(torch, rocm.RocmPlatform().fp8_e4m3_dtype())  # MI300: e4m3fnuz; MI350: OCP e4m3fn
    return torch.float8_e4m3fn


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 33, 300])  # every M bucket of the GEMM tiles
def test_fp8_block_gemm_gpu(m, device):
    # Qwen3-style: N and K not multiples of 128 (tails in both), bf16 output
    n, k, block = 576, 1088, (128, 128)
    a, b, sa, sb, bias = _operands(m, n, k, block, _gpu_fp8())
    kernel = TritonFp8BlockScaledGemm()  # fp8 dots or the fp16 upcast, as the GPU decides
    got = kernel(*(t.to(device) for t in (a, b, sa, sb)), block, torch.bfloat16, bias.to(torch.bfloat16).to(device))
    want = TorchFp8BlockScaledGemm()(a, b, sa, sb, block, torch.float32, bias.to(torch.bfloat16).float())
    torch.testing.assert_close(got.cpu().float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_per_token_group_quant_exact_gpu(dtype, device):
    fp8 = _gpu_fp8()
    x = (torch.randn(64, 7168 + 64) * 2).to(dtype)  # DeepSeek-V3's hidden size plus a half group
    q, s = TritonPerTokenGroupFp8Quant()(x.to(device), fp8, 128)
    q_ref, s_ref = TorchPerTokenGroupFp8Quant()(x, fp8, 128)
    torch.testing.assert_close(s.cpu(), s_ref)
    assert torch.equal(q.cpu().float(), q_ref.float())
