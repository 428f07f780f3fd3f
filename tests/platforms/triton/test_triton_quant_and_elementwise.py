"""Triton activation quantization, RMSNorm, rotary embedding and silu_and_mul vs the torch references."""
from __future__ import annotations

import pytest
import torch

from halserve.kernels.reference import (
    TorchRmsNorm,
    TorchRotaryEmbedding,
    TorchScaledFp8Quant,
    TorchScaledInt8Quant,
    TorchSiluAndMul,
)
from halserve.platforms.triton_kernels.activation import TritonSiluAndMul
from halserve.platforms.triton_kernels.quant import TritonScaledFp8Quant, TritonScaledInt8Quant
from halserve.platforms.triton_kernels.rms_norm import TritonRmsNorm
from halserve.platforms.triton_kernels.rotary import TritonRotaryEmbedding

DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("static", [False, True])
def test_scaled_int8_quant(dtype, static, device):
    x = (torch.randn(6, 1100) * 3).to(dtype)  # K > the 1024-wide chunk: exercises the loop
    x[0, :4] = torch.tensor([0.5, 1.5, -2.5, 2.5]).to(dtype)  # ties round half to even
    scale = torch.tensor([0.05]) if static else None
    q, s = TritonScaledInt8Quant()(x.to(device), None if scale is None else scale.to(device))
    q_ref, s_ref = TorchScaledInt8Quant()(x, scale)
    torch.testing.assert_close(s.cpu().reshape(s_ref.shape), s_ref)
    assert torch.equal(q.cpu(), q_ref)
    if static:  # 0.5 / 0.05 etc. are not ties after the division; check ties with scale 1
        q1, _ = TritonScaledInt8Quant()(x[:1, :4].float().to(device), torch.tensor([1.0], device=device))
        assert q1.cpu().tolist() == [[0, 2, -2, 2]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["static", "per_tensor", "per_token"])
def test_scaled_fp8_quant(dtype, mode, device):
    x = (torch.randn(5, 300) * 2).to(dtype)
    scale = torch.tensor([0.02]) if mode == "static" else None
    per_token = mode == "per_token"
    q, s = TritonScaledFp8Quant()(x.to(device), "float8_e4m3fn", None if scale is None else scale.to(device), per_token)
    q_ref, s_ref = TorchScaledFp8Quant()(x, "float8_e4m3fn", scale, per_token)
    assert q.dtype == torch.float8_e4m3fn and s.shape == s_ref.shape
    torch.testing.assert_close(s.cpu(), s_ref)
    # the interpreter's fp32->fp8 casts are inexact on a few % of values (triton#8322): a dropped
    # rounding carry (up to 2x too small) or a one-ulp miss (3 mantissa bits: 1/8 relative);
    # exact on the rest, and bit-exact on a GPU (test below)
    exact = q.cpu().float() == q_ref.float()
    assert exact.float().mean() > 0.9
    ratio = q.cpu().float()[~exact] / q_ref.float()[~exact]
    assert torch.all((ratio >= 0.5) & (ratio <= 1.0 + 1 / 8 + 1e-6)), ratio


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_fp8_quant_exact_gpu(dtype, device):
    fp8 = "float8_e4m3fnuz" if torch.version.hip else "float8_e4m3fn"
    x = (torch.randn(64, 512) * 2).to(dtype)
    for scale, per_token in [(None, True), (None, False), (torch.tensor([0.01]), False)]:
        q, s = TritonScaledFp8Quant()(x.to(device), fp8, None if scale is None else scale.to(device), per_token)
        q_ref, s_ref = TorchScaledFp8Quant()(x, fp8, scale, per_token)
        torch.testing.assert_close(s.cpu(), s_ref)
        assert torch.equal(q.cpu().float(), q_ref.float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual, device):
    x = torch.randn(7, 96).to(dtype)  # hidden size not a power of two
    w = (torch.rand(96) + 0.5).to(dtype)
    res = torch.randn(7, 96).to(dtype) if with_residual else None
    got = TritonRmsNorm()(x.to(device), w.to(device), 1e-6, None if res is None else res.to(device))
    want = TorchRmsNorm()(x, w, 1e-6, res)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    if with_residual:
        torch.testing.assert_close(got[1].cpu(), want[1])  # x + residual, exactly as torch rounds it
        got, want = got[0], want[0]
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "dtype,is_neox,head_size,rotary_dim",
    [(torch.float32, True, 64, 64), (torch.float16, False, 64, 64), (torch.float32, True, 80, 32),
     (torch.float32, False, 96, 48)],
)
def test_rotary_embedding(dtype, is_neox, head_size, rotary_dim, device):
    num_tokens, hq, hk, max_pos = 5, 4, 2, 32
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)  # [P, R/2]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, R]
    positions = torch.tensor([0, 3, 31, 7, 7])
    q = torch.randn(num_tokens, hq * head_size).to(dtype)
    k = torch.randn(num_tokens, hk * head_size).to(dtype)
    got_q, got_k = TritonRotaryEmbedding()(positions.to(device), q.to(device), k.to(device), cos_sin.to(device),
                                           head_size, is_neox)
    want_q, want_k = TorchRotaryEmbedding()(positions, q, k, cos_sin, head_size, is_neox)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got_q.cpu(), want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(got_k.cpu(), want_k, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype, device):
    x = torch.randn(3, 2 * 1500).to(dtype)  # intermediate size > one 1024 block
    got = TritonSiluAndMul()(x.to(device))
    want = TorchSiluAndMul()(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)


@pytest.mark.gpu
def test_bf16_elementwise_gpu(device):
    x = torch.randn(8, 4096, dtype=torch.bfloat16)
    w = torch.rand(4096, dtype=torch.bfloat16) + 0.5
    torch.testing.assert_close(TritonRmsNorm()(x.to(device), w.to(device), 1e-6).cpu(), TorchRmsNorm()(x, w, 1e-6),
                               atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(TritonSiluAndMul()(x.to(device)).cpu(), TorchSiluAndMul()(x), atol=2e-2, rtol=2e-2)
