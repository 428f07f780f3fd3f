"""The cpu platform's native 4-bit GEMMs (platforms/cpu_kernels/native_int4.py, int4_gemm.cpp) vs the
torch references, on both of its code paths (AMX tiles where this CPU and OS allow them, and the
AVX512-BF16 dot products the kernel uses without AMX).

Numerics: x rounded to bf16, float32 accumulation, the output in x's dtype. From five rows on, the
weight is ``bf16(q * s + zf)`` (``zf = -z * s``, exact for fp16 scales): ``test_numerics_are_bf16_weights``
holds the kernel to that arithmetic done in float64. Up to four rows the weight is exact (the sums of
``x * (128 + q)`` are scaled per group): ``test_few_rows_use_exact_weights``. Against the float32
references the bf16 rounding stays within ``INT4_TOL`` (measured <= 4e-3 here), while a wrong zero or a
row in the wrong group is off by a whole quantization step (>10%).
"""
import pytest
import torch

from halserve.kernels import packing, resolve_kernel
from halserve.kernels.reference import TorchAwqGemm, TorchGptqGemm
from halserve.platforms.cpu_kernels.native_int4 import NativeInt4AwqGemm, NativeInt4GptqGemm, NativeInt4Weight

INT4_TOL = 1.5e-2  # of max |ref|, as tests/platforms/test_cpu_quant_kernels.py
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_REASON = NativeInt4GptqGemm.supports(dtype="float32", n=64, k=128, group_size=128)
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"the native 4-bit GEMM does not run here: {_REASON}")


def _isas() -> list[str]:
    if _REASON is not None:
        return ["avx512_bf16"]
    return ["avx512_bf16", "amx"] if NativeInt4GptqGemm().isa == "amx" else ["avx512_bf16"]


@pytest.fixture(params=_isas())
def isa(request):
    return request.param


def _kernel(cls, isa: str):
    kernel = cls()
    kernel.isa = isa  # force the path under test (the kernel picks AMX itself where it can)
    return kernel


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-6)).item()


def _gptq(k: int, n: int, group_size: int, seed: int, act_order: bool = False):
    g = torch.Generator().manual_seed(seed)
    q, zeros, scales = packing.quantize_4bit(torch.randn(k, n, generator=g), group_size)
    g_idx = None
    if act_order:  # desc_act: row k is in group g_idx[k], a shuffled k // G
        g_idx = (torch.arange(k) // packing.group_rows(k, group_size))[torch.randperm(k, generator=g)].to(torch.int32)
    return (*packing.pack_gptq(q, zeros, scales), g_idx, group_size), g


def _check(kernel, reference, args: tuple, g: torch.Generator, k: int, ms=(1, 7, 16, 17, 40, 64)) -> None:
    prepared = kernel.prepare_weight(args)
    assert isinstance(prepared, NativeInt4Weight)
    for m in ms:
        x = torch.randn(m, k, generator=g)
        want = reference(x, *args)
        for dtype in DTYPES:
            got = kernel(x.to(dtype), prepared, *args[1:])
            assert got.dtype == dtype and got.shape == want.shape
            assert _rel_error(got, want) <= INT4_TOL, (dtype, m)
        # bf16 x is read in place, float32 x is rounded to bf16 first: the same products
        xb = x.to(torch.bfloat16)
        assert torch.equal(kernel(xb, prepared, *args[1:]), kernel(xb.float(), prepared, *args[1:]).to(torch.bfloat16))
    assert torch.equal(kernel(x, *args), kernel(x, prepared, *args[1:]))  # unprepared: same numbers


# K = 200 and 208 are not multiples of 32: padded rows; N = 40 and 264: padded columns
GPTQ_SHAPES = [(k, n, gs) for k, n in [(128, 64), (256, 40), (512, 96), (200, 32), (208, 264)]
               for gs in (16, 32, 128, -1) if gs == -1 or k % gs == 0]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("k,n,group_size", GPTQ_SHAPES)
def test_gptq_matches_reference(isa, k, n, group_size, act_order):
    args, g = _gptq(k, n, group_size, seed=k + n + group_size, act_order=act_order)
    _check(_kernel(NativeInt4GptqGemm, isa), TorchGptqGemm(), args, g, k)


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("k,n", [(128, 64), (256, 264), (512, 32)])
def test_awq_matches_reference(isa, k, n, group_size):
    g = torch.Generator().manual_seed(k * n + group_size)
    q, zeros, scales = packing.quantize_4bit(torch.randn(k, n, generator=g), group_size)
    args = (*packing.pack_awq(q, zeros, scales), group_size)
    _check(_kernel(NativeInt4AwqGemm, isa), TorchAwqGemm(), args, g, k)


def test_many_rows_cross_the_x_chunks(isa):
    # K = 4096: a pass over the panels takes 128 rows of x (~1 MB of bf16), so 300 rows take three
    args, g = _gptq(4096, 32, 128, seed=7)
    _check(_kernel(NativeInt4GptqGemm, isa), TorchGptqGemm(), args, g, 4096, ms=(300,))


def test_numerics_are_bf16_weights(isa):
    # what the kernel computes, in float64: bf16(x) @ bf16(q * s + zf), zf = -z * s, s the fp16 scales
    k, n, group_size = 256, 64, 64
    g = torch.Generator().manual_seed(3)
    q, zeros, scales = packing.quantize_4bit(torch.randn(k, n, generator=g), group_size)
    qweight, qzeros, scales16 = packing.pack_gptq(q, zeros, scales)
    x = torch.randn(9, k, generator=g)
    got = _kernel(NativeInt4GptqGemm, isa)(x, qweight, qzeros, scales16, None, group_size)
    s = scales16.float().repeat_interleave(group_size, 0)
    z = zeros.float().repeat_interleave(group_size, 0)
    w = torch.addcmul(-z * s, q.float(), s).to(torch.bfloat16).double()  # one rounding of q * s - z * s
    want = x.to(torch.bfloat16).double() @ w
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_few_rows_use_exact_weights(m):
    # decode rows: bf16(x) @ ((q - z) * s) with the weight exact; the per-group centring of the sums of
    # x * (128 + q) costs float32 cancellation (~136 x 2^-24 of the sums), far below bf16's 2^-9
    k, n, group_size = 512, 96, 128
    g = torch.Generator().manual_seed(11)
    q, zeros, scales = packing.quantize_4bit(torch.randn(k, n, generator=g), group_size)
    args = (*packing.pack_gptq(q, zeros, scales), None, group_size)
    x = torch.randn(m, k, generator=g)
    got = NativeInt4GptqGemm()(x, *args)
    rows = torch.arange(k) // group_size
    w = (q.double() - zeros.double()[rows]) * args[2].double()[rows]
    want = x.to(torch.bfloat16).double() @ w
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_tensor_parallel_act_order_rank(isa):
    # a row-parallel rank: half of K's rows, act-order g_idx indexing all the global groups
    k, n, group_size = 512, 64, 128
    g = torch.Generator().manual_seed(2)
    q, zeros, scales = packing.quantize_4bit(torch.randn(k, n, generator=g), group_size)
    g_idx = (torch.arange(k) // group_size)[torch.randperm(k, generator=g)].to(torch.int32)
    qweight, qzeros, scales = packing.pack_gptq(q[: k // 2], zeros, scales)
    args = (qweight, qzeros, scales, g_idx[: k // 2], group_size)
    kernel = _kernel(NativeInt4GptqGemm, isa)
    prepared = kernel.prepare_weight(args)
    assert prepared.src is not None and prepared.src.numel() % 32 == 0 and prepared.src.numel() > k // 2
    x = torch.randn(5, k // 2, generator=g)
    assert _rel_error(kernel(x, prepared, *args[1:]), TorchGptqGemm()(x, *args)) <= INT4_TOL


def test_layout_in_order_needs_no_gather():
    args, _ = _gptq(256, 64, 64, seed=1)
    prepared = NativeInt4GptqGemm().prepare_weight(args)
    assert prepared.src is None and prepared.qpack.shape == (64 // 16, 256 // 32, 16, 16)
    assert prepared.scales.shape == (256 // 64, 64) and prepared.block_group.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_errors_name_the_problem():
    args, _ = _gptq(128, 64, 64, seed=5)
    kernel = NativeInt4GptqGemm()
    with pytest.raises(ValueError, match="scales"):
        kernel.prepare_weight((*args[:2], args[2][:, :32], None, 64))
    with pytest.raises(ValueError, match="K=128"):
        kernel(torch.randn(2, 96), *args)


def test_resolved_on_the_cpu_platform():
    assert isinstance(resolve_kernel("gptq_gemm", "cpu", dtype="bfloat16", n=4096, k=4096, group_size=128),
                      NativeInt4GptqGemm)
    # groups torch's int4 kernel cannot take (16 rows) and N not a multiple of 16 run natively too
    assert isinstance(resolve_kernel("awq_gemm", "cpu", dtype="float32", n=40, k=256, group_size=16),
                      NativeInt4AwqGemm)
