"""The cpu platform's W8A8 int8 GEMMs (platforms/cpu_kernels/native_int8.py and onednn_int8_gemm.py, both
AMX-only, with int8_gemm.cpp) vs ``TorchInt8ScaledGemm``.

Tolerances. Both sum int8 x int8 exactly in int32. The native kernel then applies the scales and bias
in the reference's order and rounds as torch does: bitwise equal everywhere. The oneDNN kernel is
bitwise equal with per-token x scales (its C++ epilogue) and for float16 output; with one static x
scale and bfloat16/float32 output oneDNN scales and adds the bias itself, in its own order:
|error| <= 2 eps (of the output dtype) x (|acc scale_a scale_b| + |bias|) (measured <= 1.95 eps).
"""
import itertools

import pytest
import torch

from halserve.kernels import resolve_kernel
from halserve.kernels.reference import TorchInt8ScaledGemm
from halserve.platforms.cpu_kernels import onednn_int8_gemm
from halserve.platforms.cpu_kernels.native_int8 import NativeInt8ScaledGemm, NativeInt8Weight, pack_int8
from halserve.platforms.cpu_kernels.onednn_int8_gemm import OneDnnInt8ScaledGemm
from halserve.platforms.cpu_kernels.quant_gemm import CpuInt8ScaledGemm

KERNELS = (NativeInt8ScaledGemm, OneDnnInt8ScaledGemm)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (N, K): single elements, odd sizes, N below one panel (32) and K below one block (64), K exactly one
# block, several panels with a partial last one, and W1's down projection
SHAPES = ((1, 1), (33, 17), (48, 80), (31, 64), (257, 129), (768, 2048))
MS = (0, 1, 2, 15, 16, 17, 33, 64, 300)


@pytest.fixture(scope="module", params=KERNELS, ids=lambda cls: cls.name)
def kernel(request):
    reason = request.param.supports(dtype="int8", n=64, k=64)
    if reason is not None:
        pytest.skip(f"{request.param.name} does not run here: {reason}")
    return request.param()


def _problem(m, n, k, static, per_channel, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale_a = torch.rand(1, generator=g) * 1e-2 if static else torch.rand(m, 1, generator=g) * 1e-2
    scale_b = torch.rand(n, 1, generator=g) * 1e-2 if per_channel else torch.tensor([2e-2])
    return a, b, scale_a, scale_b, torch.randn(n, generator=g)


def _check(kernel, got, want, a, b, scale_a, scale_b, bias, out_dtype):
    assert got.dtype == out_dtype and got.shape == want.shape
    exact = isinstance(kernel, NativeInt8ScaledGemm) or scale_a.numel() != 1 or out_dtype == torch.float16
    if exact:
        assert torch.equal(got, want)
        return
    # oneDNN's own order of the scales and bias: within 2 eps of the terms' magnitude
    terms = (a.double() @ b.double().T) * scale_a.double().reshape(-1, 1) * scale_b.double().reshape(1, -1)
    if bias is not None:
        terms = terms.abs() + bias.double().abs()
    bound = 2 * torch.finfo(out_dtype).eps * terms.abs()
    assert ((got.double() - want.double()).abs() <= bound).all()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", MS)
def test_matches_the_reference(kernel, m, n, k):
    reference = TorchInt8ScaledGemm()
    for i, (static, per_channel) in enumerate(itertools.product((False, True), repeat=2)):
        a, b, scale_a, scale_b, bias_f32 = _problem(m, n, k, static, per_channel, seed=1000 * m + n + i)
        prepared = kernel.prepare_weight(b)
        for out_dtype, with_bias in itertools.product(OUT_DTYPES, (False, True)):
            bias = bias_f32.to(out_dtype) if with_bias else None
            want = reference(a, b, scale_a, scale_b, out_dtype, bias)
            for weight in (prepared, b):  # prepared once, or packed on the call
                got = kernel(a, weight, scale_a, scale_b, out_dtype, bias)
                _check(kernel, got, want, a, b, scale_a, scale_b, bias, out_dtype)


@pytest.mark.parametrize("m,n,k", [(1100, 20, 200), (1100, 257, 80), (700, 768, 2048)])
def test_many_rows(kernel, m, n, k):
    # the native kernel's work split: one 32-column panel (threads share the rows), a few panels per
    # thread, and several L2 blocks of panels per thread (K = 2048: 8 panels a block)
    a, b, scale_a, scale_b, bias = _problem(m, n, k, static=False, per_channel=True, seed=m + n + k)
    want = TorchInt8ScaledGemm()(a, b, scale_a, scale_b, torch.bfloat16, bias.bfloat16())
    assert torch.equal(kernel(a, kernel.prepare_weight(b), scale_a, scale_b, torch.bfloat16, bias.bfloat16()), want)


def test_non_contiguous_activations(kernel):
    a, b, scale_a, scale_b, _ = _problem(40, 48, 128, static=False, per_channel=True, seed=7)
    wide = torch.zeros(40, 256, dtype=torch.int8)
    wide[:, ::2] = a
    strided = wide[:, ::2]
    want = TorchInt8ScaledGemm()(a, b, scale_a, scale_b, torch.float32)
    assert torch.equal(kernel(strided, kernel.prepare_weight(b), scale_a, scale_b, torch.float32), want)


def test_onednn_torch_epilogue_is_the_reference():
    # the oneDNN kernel's fallback where int8_gemm.cpp cannot be built
    reason = OneDnnInt8ScaledGemm.supports(dtype="int8", n=48, k=80)
    if reason is not None:
        pytest.skip(f"onednn_int8 does not run here: {reason}")
    kernel = OneDnnInt8ScaledGemm()
    kernel.epilogue = onednn_int8_gemm.torch_epilogue
    for static, out_dtype in [(False, torch.bfloat16), (False, torch.float32), (True, torch.float16)]:
        a, b, scale_a, scale_b, bias = _problem(33, 48, 80, static=static, per_channel=True, seed=11)
        want = TorchInt8ScaledGemm()(a, b, scale_a, scale_b, out_dtype, bias.to(out_dtype))
        assert torch.equal(kernel(a, b, scale_a, scale_b, out_dtype, bias.to(out_dtype)), want)


def test_rejects_mismatched_inputs(kernel):
    b = torch.randint(-128, 128, (48, 80), dtype=torch.int8)
    with pytest.raises(ValueError, match="int8"):
        kernel.prepare_weight(b.float())
    prepared = kernel.prepare_weight(b)
    with pytest.raises(ValueError, match="K=80"):
        kernel(torch.zeros(4, 64, dtype=torch.int8), prepared, torch.ones(4, 1), torch.ones(48, 1), torch.float32)


def test_declines_empty_weights():
    for cls in KERNELS:
        assert "N, K >= 1" in cls.supports(dtype="int8", n=0, k=64)
        assert "N, K >= 1" in cls.supports(dtype="int8", n=64, k=0)


def test_pack_layout():
    b = torch.randint(-128, 128, (40, 70), dtype=torch.int8)
    w = pack_int8(b)
    assert isinstance(w, NativeInt8Weight) and (w.n, w.k) == (40, 70)
    assert w.qpack.shape == (2, 2, 2, 16, 64)  # N 40 -> 64 (2 panels), K 70 -> 128 (2 blocks)
    for p, kb, t, r, j in [(0, 0, 0, 0, 0), (0, 1, 1, 1, 5), (1, 0, 0, 1, 28), (0, 0, 1, 15, 63)]:
        n, k = 32 * p + 16 * t + j // 4, 64 * kb + 4 * r + j % 4
        assert w.qpack[p, kb, t, r, j] == b[n, k]
    assert (w.qpack[1, :, 0, :, 32:] == 0).all() and (w.qpack[1, :, 1] == 0).all()  # columns 40..63: N padding
    assert (w.qpack[:, 1, :, 2:] == 0).all()  # k 72..127: K padding


def test_onednn_declines_below_amx(monkeypatch):
    # an ISA cap below AMX would send int8 x int8 down oneDNN's slow reference path
    if onednn_int8_gemm.unsupported_reason() is not None:  # e.g. no AMX: nothing for a cap to take away
        pytest.skip(f"onednn_int8 declines here anyway: {onednn_int8_gemm.unsupported_reason()}")
    onednn_int8_gemm.unsupported_reason.cache_clear()
    try:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI")
        assert "capped below AMX (AVX512_CORE_VNNI" in OneDnnInt8ScaledGemm.supports(dtype="int8", n=64, k=64)
    finally:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
        onednn_int8_gemm.unsupported_reason.cache_clear()


def test_resolution_order():
    chosen = type(resolve_kernel("int8_scaled_gemm", "cpu", dtype="int8", n=64, k=80))
    expected = next(cls for cls in (*KERNELS, CpuInt8ScaledGemm) if cls.supports(dtype="int8", n=64, k=80) is None)
    assert chosen is expected
    # a problem the new kernels decline still resolves (torch._int_mm takes any shape)
    assert isinstance(resolve_kernel("int8_scaled_gemm", "cpu", dtype="int8", n=0, k=80), CpuInt8ScaledGemm)
