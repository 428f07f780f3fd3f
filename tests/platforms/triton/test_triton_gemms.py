"""Triton W8A8 (fp8, int8) and W4A16 (AWQ, GPTQ) GEMMs against the torch references."""
from __future__ import annotations

import pytest
import torch

from halserve.kernels import packing
from halserve.kernels.reference import TorchAwqGemm, TorchFp8ScaledGemm, TorchGptqGemm, TorchInt8ScaledGemm
from halserve.platforms.triton_kernels.fp8_gemm import CudaScaledMmFp8Gemm, TritonFp8ScaledGemm
from halserve.platforms.triton_kernels.int8_gemm import TritonInt8ScaledGemm
from halserve.platforms.triton_kernels.wo4_gemm import TritonAwqGemm, TritonGptqGemm

# M not a multiple of the tile, K with a tail, N spanning two tiles
M, N, K = 5, 48, 80


def _fp8_operands(device, fp8=torch.float8_e4m3fn, per_token=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(M, K, generator=g) * 4).to(fp8)
    b = (torch.randn(N, K, generator=g) * 4).to(fp8)
    scale_a = torch.rand(M, 1, generator=g) + 0.5 if per_token else torch.tensor([0.7])
    scale_b = torch.rand(N, 1, generator=g) + 0.5 if per_token else torch.tensor([1.3])
    bias = torch.randn(N, generator=g)
    return [t.to(device) for t in (a, b, scale_a, scale_b, bias)]


@pytest.mark.parametrize(
    "fp8,per_token,out_dtype,upcast",
    [
        (torch.float8_e4m3fn, True, torch.float32, False),
        (torch.float8_e5m2, False, torch.float16, False),
        (torch.float8_e4m3fn, True, torch.float16, True),  # the fp16-upcast path of pre-sm89 GPUs
        (torch.float8_e4m3fnuz, False, torch.float32, True),  # pre-MI300 AMD GPUs, ROCm's flavour
    ],
)
def test_fp8_scaled_gemm(fp8, per_token, out_dtype, upcast, device):
    a, b, sa, sb, bias = _fp8_operands(device, fp8, per_token)
    kernel = TritonFp8ScaledGemm(upcast=upcast)
    got = kernel(a, b, sa, sb, out_dtype, bias)
    want = TorchFp8ScaledGemm()(a.cpu(), b.cpu(), sa.cpu(), sb.cpu(), out_dtype, bias.cpu())
    assert got.dtype == out_dtype
    tol = 1e-4 if out_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol)


@pytest.mark.parametrize(
    "fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz]
)
def test_fp8_upcast_decodes_every_code_exactly(fp8, device):
    # GPUs without fp8 dots get the codes as uint8 and decode them by moving bit fields:
    # a @ I.T with a = all 256 codes returns each decoded value, to compare with torch's cast
    codes = torch.arange(256, dtype=torch.uint8)
    finite = torch.isfinite(codes.view(fp8).float())  # NaN/inf codes are outside the decoder's contract
    codes[~finite] = 0  # (inf * 0 would turn every sum into NaN)
    values = codes.view(fp8).float()
    a = codes.view(fp8).reshape(1, 256)
    eye = torch.eye(256).to(fp8)
    one = torch.ones(1)
    kernel = TritonFp8ScaledGemm(upcast=True)
    got = kernel(a.to(device), eye.to(device), one.to(device), one.to(device), torch.float32).cpu().reshape(256)
    torch.testing.assert_close(got, values, atol=0, rtol=0)


def test_scaled_gemm_rejects_mixed_fp8_operands(device):
    a = torch.zeros(2, 16).to(torch.float8_e4m3fn)
    b = torch.zeros(4, 16).to(torch.float8_e5m2)
    with pytest.raises(ValueError, match="same dtype"):
        TritonFp8ScaledGemm()(a.to(device), b.to(device), torch.ones(1), torch.ones(1), torch.float32)


@pytest.mark.parametrize("per_token,bias", [(True, True), (False, False)])
def test_int8_scaled_gemm(per_token, bias, device):
    g = torch.Generator().manual_seed(1)
    a = torch.randint(-128, 128, (M, K), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    sa = torch.rand(M, 1, generator=g) * 0.01 if per_token else torch.tensor([0.01])
    sb = torch.rand(N, 1, generator=g) * 0.01 if per_token else torch.tensor([0.02])
    bias_t = torch.randn(N, generator=g) if bias else None
    args = [a, b, sa, sb]
    got = TritonInt8ScaledGemm()(*[t.to(device) for t in args], torch.float32,
                                 bias_t.to(device) if bias else None)
    want = TorchInt8ScaledGemm()(*args, torch.float32, bias_t)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-5)  # int32 accumulation is exact


def _wo4_problem(k, n, group_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(k, n, generator=g)
    return packing.quantize_4bit(w, group_size)


@pytest.mark.parametrize(
    "dtype,group_size,m", [(torch.float32, 128, 3), (torch.float16, -1, 17), (torch.float32, 32, 5), (torch.float32, 64, 2)]
)
def test_awq_gemm(dtype, group_size, m, device):
    k, n = 256, 40
    q, zeros, scales = _wo4_problem(k, n, group_size)
    qw, qz, s = packing.pack_awq(q, zeros, scales, dtype=dtype)
    x = torch.randn(m, k).to(dtype)
    want = TorchAwqGemm()(x, qw, qz, s, group_size)
    got = TritonAwqGemm()(x.to(device), qw.to(device), qz.to(device), s.to(device), group_size)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol)


@pytest.mark.parametrize(
    "dtype,group_size,act_order",
    [(torch.float32, 128, False), (torch.float16, 128, True), (torch.float32, -1, False), (torch.float32, 32, False),
     (torch.float32, 32, True)],
)
def test_gptq_gemm(dtype, group_size, act_order, device):
    k, n, m = 256, 24, 4
    q, zeros, scales = _wo4_problem(k, n, group_size, seed=1)
    qw, qz, s = packing.pack_gptq(q, zeros, scales, dtype=dtype)
    g_idx = None
    if act_order:  # desc_act checkpoints: row k belongs to group g_idx[k], not k // G
        g_idx = (torch.arange(k) // group_size)[torch.randperm(k)].to(torch.int32)
    x = torch.randn(m, k).to(dtype)
    want = TorchGptqGemm()(x, qw, qz, s, g_idx, group_size)
    got = TritonGptqGemm()(x.to(device), qw.to(device), qz.to(device), s.to(device),
                           g_idx.to(device) if act_order else None, group_size)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol)


def test_wo4_rejects_k_not_a_multiple_of_8_for_gptq(device):
    x = torch.zeros(2, 84)
    with pytest.raises(ValueError, match="multiples of 8, got N=16, K=84"):
        TritonGptqGemm()(x.to(device), torch.zeros(10, 16, dtype=torch.int32).to(device),
                         torch.zeros(1, 2, dtype=torch.int32).to(device), torch.ones(1, 16).to(device), None, -1)


def test_supports_reasons():
    assert TritonAwqGemm.supports(dtype="float16", n=4096, k=4096, group_size=128) is None
    assert "group size 96" in TritonAwqGemm.supports(dtype="float16", n=4096, k=4096, group_size=96)
    assert "multiple of 8" in TritonGptqGemm.supports(dtype="float16", n=4092, k=4096, group_size=128)
    assert "int8" in TritonInt8ScaledGemm.supports(dtype="float16", n=64, k=64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_wo4_bf16_gpu(dtype, device):
    k, n = 512, 256
    q, zeros, scales = _wo4_problem(k, n, 128)
    qw, qz, s = packing.pack_awq(q, zeros, scales, dtype=dtype)
    x = torch.randn(33, k).to(dtype)
    want = TorchAwqGemm()(x, qw, qz, s, 128)
    got = TritonAwqGemm()(x.to(device), qw.to(device), qz.to(device), s.to(device), 128)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=2e-2 * want.abs().max().item(), rtol=2e-2)


@pytest.mark.gpu
def test_cuda_scaled_mm_gpu(device):
    if CudaScaledMmFp8Gemm.supports(dtype="float8_e4m3fn", n=64, k=64, fp8_dtype="float8_e4m3fn") is not None:
        pytest.skip("no sm89+ NVIDIA GPU")
    kernel = CudaScaledMmFp8Gemm()
    g = torch.Generator().manual_seed(0)
    a = torch.randn(32, 64, generator=g).to(torch.float8_e4m3fn).to(device)
    b = torch.randn(64, 64, generator=g).to(torch.float8_e4m3fn).to(device)
    for sa, sb, out_dtype in [
        (torch.tensor([0.5]), torch.tensor([2.0]), torch.float16),
        (torch.rand(32, 1) + 0.5, torch.rand(64, 1) + 0.5, torch.bfloat16),
        (torch.rand(32, 1) + 0.5, torch.rand(64, 1) + 0.5, torch.float16),  # Triton fallback
    ]:
        got = kernel(a, b, sa.to(device), sb.to(device), out_dtype)
        want = TorchFp8ScaledGemm()(a.cpu(), b.cpu(), sa, sb, out_dtype)
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=2e-2 * want.abs().max().item(), rtol=2e-2)
