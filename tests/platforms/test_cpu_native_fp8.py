"""The cpu platform's native fp8 GEMMs (platforms/cpu_kernels/native_fp8.py, fp8_gemm.cpp) vs the torch
references, on both code paths (AMX tiles where this CPU and OS allow them, AVX512-BF16 otherwise).

Both fp8 operands are exact in bf16 and summed in float32, with per-token/channel/tensor scales applied
at the end and block scales to each group's sums, so the float32 output equals the reference's up to
summation order (measured <= 6e-7 of max |ref|; ``EXACT_TOL`` 1e-5), where a wrong scale block or a
misplaced byte is off by far more.
"""
import pytest
import torch

from halserve.kernels import resolve_kernel
from halserve.kernels.reference import (
    TorchFp8BlockScaledGemm,
    TorchFp8ScaledGemm,
    TorchPerTokenGroupFp8Quant,
    TorchScaledFp8Quant,
)
from halserve.platforms.cpu_kernels.native_fp8 import (
    NativeFp8BlockScaledGemm,
    NativeFp8ScaledGemm,
    NativeFp8Weight,
    NativePerTokenGroupFp8Quant,
    NativeScaledFp8Quant,
    pack_fp8,
)

EXACT_TOL = 1e-5
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

_REASON = NativeFp8ScaledGemm.supports(dtype="float8_e4m3fn", n=64, k=64, fp8_dtype="float8_e4m3fn")
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"the native fp8 GEMM does not run here: {_REASON}")


def _isas() -> list[str]:
    if _REASON is not None:
        return ["avx512_bf16"]
    return ["avx512_bf16", "amx"] if NativeFp8ScaledGemm().isa == "amx" else ["avx512_bf16"]


@pytest.fixture(params=_isas())
def isa(request):
    return request.param


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-6)).item()


def _quantize(t: torch.Tensor, fp8: torch.dtype, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    amax = t.abs().amax(dim=1, keepdim=True) if per_row else t.abs().amax().reshape(1)
    scale = (amax / torch.finfo(fp8).max).clamp(min=1e-12)
    return (t / scale).to(fp8), scale.float()


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (5, 100, 40), (17, 768, 96), (300, 512, 64), (40, 4096, 32)])
def test_scaled_gemm_matches_reference(isa, fp8, m, k, n):
    g = torch.Generator().manual_seed(m * k + n)
    b, sb = _quantize(torch.randn(n, k, generator=g) * 0.05, fp8, per_row=True)
    a, sa = _quantize(torch.randn(m, k, generator=g), fp8, per_row=True)
    bias = torch.randn(n, generator=g)
    kernel = NativeFp8ScaledGemm()
    kernel.isa = isa
    prepared = kernel.prepare_weight(b)
    assert isinstance(prepared, NativeFp8Weight)
    reference = TorchFp8ScaledGemm()
    for scales in ((sa, sb), (sa.max().reshape(1), sb.max().reshape(1))):  # per token/channel, per tensor
        for bias_arg in (None, bias):
            want = reference(a, b, *scales, torch.float32, bias_arg)
            got = kernel(a, prepared, *scales, torch.float32, bias_arg)
            assert got.dtype == torch.float32 and _rel_error(got, want) <= EXACT_TOL
    for out_dtype in (torch.bfloat16, torch.float16):  # the float32 result rounded once
        got = kernel(a, prepared, sa, sb, out_dtype, bias)
        assert got.dtype == out_dtype
        assert _rel_error(got, reference(a, b, sa, sb, torch.float32, bias)) <= 2**-8
    assert torch.equal(kernel(a, b, sa, sb, torch.float32), kernel(a, prepared, sa, sb, torch.float32))


def test_fp8_bytes_convert_exactly_subnormals_included(isa):
    # every e4m3fn value but NaN, as the weight of one-hot rows: out[i, j] = value j exactly
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = values[~values.float().isnan()]  # [254]
    n = finite.numel()
    b = finite.reshape(n, 1).repeat(1, 32)  # [N, K]: row j holds value j
    a = torch.zeros(1, 32, dtype=torch.float8_e4m3fn)
    a[0, 0] = 1.0
    kernel = NativeFp8ScaledGemm()
    kernel.isa = isa
    got = kernel(a, b, torch.ones(1), torch.ones(1), torch.float32)
    assert torch.equal(got[0], finite.float())


BLOCKS = [(3, 256, 256, (128, 128)), (40, 384, 160, (128, 128)), (9, 200, 72, (64, 64)), (33, 96, 48, (16, 32))]


@pytest.mark.parametrize("m,k,n,block", BLOCKS)
def test_block_scaled_gemm_matches_reference(isa, m, k, n, block):
    g = torch.Generator().manual_seed(m + k + n)
    bn, bk = block
    groups = -(-k // bk)
    b = (torch.randn(n, k, generator=g) * 100).clamp(-440, 440).to(torch.float8_e4m3fn)
    sb = torch.rand(-(-n // bn), groups, generator=g) * 1e-3 + 1e-4
    a = (torch.randn(m, k, generator=g) * 50).to(torch.float8_e4m3fn)
    sa = torch.rand(m, groups, generator=g) + 0.1
    bias = torch.randn(n, generator=g)
    kernel = NativeFp8BlockScaledGemm()
    kernel.isa = isa
    want = TorchFp8BlockScaledGemm()(a, b, sa, sb, block, torch.float32, bias)
    got = kernel(a, kernel.prepare_weight(b), sa, sb, block, torch.float32, bias)
    assert _rel_error(got, want) <= EXACT_TOL


def test_pack_layout():
    b = torch.arange(64 * 32, dtype=torch.int32).remainder(251).to(torch.uint8).reshape(64, 32)
    packed = pack_fp8(b.view(torch.float8_e4m3fn))
    assert packed.qpack.shape == (4, 1, 16, 32)
    # byte j of tile row r of column tile t: column 16 t + j // 2, row 2 r + j % 2
    t, r, j = 2, 5, 7
    assert packed.qpack[t, 0, r, j] == b[16 * t + j // 2, 2 * r + j % 2]


def test_errors_name_the_problem():
    kernel = NativeFp8ScaledGemm()
    b = torch.zeros(32, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="K=64"):
        kernel(torch.zeros(2, 32, dtype=torch.float8_e4m3fn), b, torch.ones(1), torch.ones(1), torch.float32)
    with pytest.raises(ValueError, match="same fp8 flavour"):
        kernel(torch.zeros(2, 64, dtype=torch.float8_e5m2), b, torch.ones(1), torch.ones(1), torch.float32)
    with pytest.raises(RuntimeError, match="scale_a must hold 1 or 2 values"):
        kernel(torch.zeros(2, 64, dtype=torch.float8_e4m3fn), b, torch.ones(3), torch.ones(1), torch.float32)
    assert "multiple of (16, 32)" in NativeFp8BlockScaledGemm.supports(
        dtype="float8_e4m3fn", n=64, k=64, block_size=(8, 8), fp8_dtype="float8_e4m3fn")


def test_resolved_on_the_cpu_platform():
    assert isinstance(resolve_kernel("fp8_scaled_gemm", "cpu", dtype="float8_e4m3fn", n=64, k=64,
                                     fp8_dtype="float8_e4m3fn"), NativeFp8ScaledGemm)
    assert isinstance(resolve_kernel("fp8_block_scaled_gemm", "cpu", dtype="float8_e4m3fn", n=256, k=256,
                                     block_size=(128, 128), fp8_dtype="float8_e4m3fn"), NativeFp8BlockScaledGemm)


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_activation_quant_is_bitwise_the_reference(fp8, dtype):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(37, 300, generator=g) * 30).to(dtype)
    x[3, 7] = 0.0
    x[5] = 0.0  # an all-zero row: the scale floor
    native, reference = NativeScaledFp8Quant(), TorchScaledFp8Quant()
    for scale, per_token in ((None, True), (None, False), (torch.tensor([0.05]), False)):
        got, want = native(x, fp8, scale, per_token=per_token), reference(x, fp8, scale, per_token=per_token)
        assert _same_bits(got[0], want[0]) and torch.equal(got[1], want[1]) and got[1].shape == want[1].shape
    grouped, group_reference = NativePerTokenGroupFp8Quant(), TorchPerTokenGroupFp8Quant()
    for group in (64, 128, 300, 512):
        got, want = grouped(x, fp8, group), group_reference(x, fp8, group)
        assert _same_bits(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="group_size"):
        grouped(x, fp8, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_activation_quant_rounds_every_e4m3fn_edge_like_torch(dtype):
    """The vectorized float -> e4m3fn conversion against torch's on the hard cases: every code, the
    midpoint between neighbours (ties go to even), just either side of it, the subnormal range, +-0,
    the clamp at 448 and NaN (rows of 16 and a ragged tail)."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[~codes.isnan()].unique()  # sorted, -448 .. 448
    mid = (finite[1:] + finite[:-1]) / 2
    values = torch.cat([finite, mid, mid.nextafter(torch.tensor(float("inf"))),
                        mid.nextafter(torch.tensor(float("-inf"))), torch.tensor([2.0**-10, -(2.0**-12), 2.0**-20,
                                                                                   -0.0, 500.0, -1e9, float("nan")])])
    values = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(0))]
    x = values[: values.numel() // 37 * 37].reshape(37, -1).to(dtype)
    native, reference = NativeScaledFp8Quant(), TorchScaledFp8Quant()
    scale = torch.tensor([1.0])
    got, want = native(x, torch.float8_e4m3fn, scale, per_token=False), reference(x, torch.float8_e4m3fn, scale,
                                                                                  per_token=False)
    assert _same_bits(got[0], want[0])
