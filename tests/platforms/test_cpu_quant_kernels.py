"""The cpu platform's quantized GEMMs (platforms/cpu_kernels/quant_gemm.py) vs the torch references.

Tolerances. The 4-bit kernels compute in bfloat16 whatever the activation dtype: x, the scales
and the float zeros ``zf = (8 - z) * s`` are rounded to bf16 (relative 2^-9 each), products are
accumulated in fp32 and the output is rounded to bf16 (2^-9 of |out|). Against the fp32
references that measures at most 7.8e-3 of max |ref| over this grid (bf16 activations, where the
reference rounds its output to bf16 too), so ``INT4_TOL = 1.5e-2`` of max |ref|. A wrong zero
or a row in the wrong group is off by a whole quantization step (>10%). ``test_int4_numerics_are_bf16_rounding``
pins the numerics tighter: against the same arithmetic in float64 from the bf16-rounded inputs,
only the output rounding (2^-9, tested at 2^-8) remains. The int8 kernel is bitwise equal to its
reference (exact int32 accumulation, then the same float32 operations in the same order).
"""
import pytest
import torch

from halserve.kernels import packing, resolve_kernel
from halserve.kernels.reference import TorchAwqGemm, TorchGptqGemm, TorchInt8ScaledGemm
from halserve.platforms.cpu_kernels.native_int4 import NativeInt4AwqGemm, NativeInt4GptqGemm
from halserve.platforms.cpu_kernels.quant_gemm import (
    CpuInt4AwqGemm,
    CpuInt4GptqGemm,
    CpuInt4Weight,
    CpuInt8ScaledGemm,
)

INT4_TOL = 1.5e-2  # of max |ref|; measured <= 7.8e-3 (see the module docstring)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MS = (1, 7, 64)


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-6)).item()


def _quantized(k: int, n: int, group_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return packing.quantize_4bit(torch.randn(k, n, generator=g), group_size), g


def _act_order(k: int, group_size: int, g: torch.Generator) -> torch.Tensor:
    # desc_act: row k is in group g_idx[k], a shuffled k // G (rows of a group are not contiguous)
    return (torch.arange(k) // packing.group_rows(k, group_size))[torch.randperm(k, generator=g)].to(torch.int32)


def _check_both_weights(kernel, reference, weight_args: tuple, g: torch.Generator, k: int) -> None:
    """Every (M, dtype) with the prepared weight and with the plain int32 one."""
    prepared = kernel.prepare_weight(weight_args)
    assert isinstance(prepared, CpuInt4Weight)
    for dtype in DTYPES:
        for m in MS:
            x = torch.randn(m, k, generator=g).to(dtype)
            want = reference(x, *weight_args)
            got = kernel(x, prepared, *weight_args[1:])
            assert got.dtype == dtype and got.shape == want.shape
            assert _rel_error(got, want) <= INT4_TOL, (dtype, m)
            assert torch.equal(kernel(x, *weight_args), got)  # unprepared: same numbers


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("n", [64, 256])
@pytest.mark.parametrize("k", [128, 256, 512])
def test_gptq_matches_reference(k, n, group_size, act_order):
    (q, zeros, scales), g = _quantized(k, n, group_size, seed=k + n + group_size)
    qweight, qzeros, scales = packing.pack_gptq(q, zeros, scales)  # fp16 scales, as checkpoints
    g_idx = _act_order(k, group_size, g) if act_order else None
    _check_both_weights(CpuInt4GptqGemm(), TorchGptqGemm(), (qweight, qzeros, scales, g_idx, group_size), g, k)


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("n", [64, 256])
@pytest.mark.parametrize("k", [128, 256, 512])
def test_awq_matches_reference(k, n, group_size):
    (q, zeros, scales), g = _quantized(k, n, group_size, seed=k * n + group_size)
    qweight, qzeros, scales = packing.pack_awq(q, zeros, scales)
    _check_both_weights(CpuInt4AwqGemm(), TorchAwqGemm(), (qweight, qzeros, scales, group_size), g, k)


def test_gptq_g_idx_layouts():
    (q, zeros, scales), g = _quantized(256, 64, 64, seed=1)
    qweight, qzeros, scales = packing.pack_gptq(q, zeros, scales)
    kernel = CpuInt4GptqGemm()
    in_order = torch.arange(256, dtype=torch.int32) // 64  # a checkpoint's trivial g_idx: no gather
    assert kernel.prepare_weight((qweight, qzeros, scales, in_order, 64)).src is None
    shuffled = kernel.prepare_weight((qweight, qzeros, scales, _act_order(256, 64, g), 64))
    assert shuffled.src is not None and shuffled.src.numel() == 256 and shuffled.group_size == 64  # no padding


def test_gptq_tensor_parallel_act_order_rank():
    # A row-parallel rank holds half of K's rows with act-order: its g_idx indexes all the global
    # groups, a different number of rows in each, so groups are padded to whole torch groups.
    k, n, group_size = 512, 64, 128
    (q, zeros, scales), g = _quantized(k, n, group_size, seed=2)
    g_idx = _act_order(k, group_size, g)
    qweight, qzeros, scales = packing.pack_gptq(q[: k // 2], zeros, scales)  # the rank's rows, all groups
    args = (qweight, qzeros, scales, g_idx[: k // 2], group_size)
    kernel = CpuInt4GptqGemm()
    prepared = kernel.prepare_weight(args)
    assert prepared.src.numel() > k // 2  # padding rows
    x = torch.randn(5, k // 2, generator=g)
    assert _rel_error(kernel(x, prepared, *args[1:]), TorchGptqGemm()(x, *args)) <= INT4_TOL


def test_int4_numerics_are_bf16_rounding():
    # what the kernel computes, in float64: bf16 x, bf16 s, bf16 zf = bf16((8 - z) * s), then w = (q - 8) s + zf
    k, n, group_size = 256, 64, 64
    (q, zeros, scales), g = _quantized(k, n, group_size, seed=3)
    qweight, qzeros, scales16 = packing.pack_gptq(q, zeros, scales)
    x = torch.randn(9, k, generator=g)
    got = CpuInt4GptqGemm()(x, qweight, qzeros, scales16, None, group_size)
    s = scales16.float().to(torch.bfloat16).double()
    zf = ((8 - zeros).double() * s).to(torch.bfloat16).double()
    w = (q.double() - 8) * s.repeat_interleave(group_size, 0) + zf.repeat_interleave(group_size, 0)
    want = x.to(torch.bfloat16).double() @ w
    assert bool(((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-5 * want.abs().max()).all())


def test_torch_int4_kernel_convention():
    # the convention the repacking relies on: w[k, n] = (q[n, k] - 8) * s[k // G, n] + zf[k // G, n]
    g = torch.Generator().manual_seed(4)
    n, k, group = 32, 64, 32
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    s, zf = torch.rand(k // group, n, generator=g) + 0.5, torch.randn(k // group, n, generator=g)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    x = torch.randn(3, k, generator=g)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, torch.stack([s, zf], -1))
    rows = torch.arange(k) // group
    torch.testing.assert_close(got, x @ ((q.T.float() - 8) * s[rows] + zf[rows]), rtol=1e-5, atol=1e-4)


def test_resolution_and_declines():
    # the native kernel (native_int4.py, priority 9) wins where the CPU has AVX512-BF16
    native = NativeInt4GptqGemm.supports(dtype="float32", n=4096, k=4096, group_size=128) is None
    gptq, awq = (NativeInt4GptqGemm, NativeInt4AwqGemm) if native else (CpuInt4GptqGemm, CpuInt4AwqGemm)
    assert isinstance(resolve_kernel("gptq_gemm", "cpu", dtype="float32", n=4096, k=4096, group_size=128), gptq)
    assert isinstance(resolve_kernel("awq_gemm", "cpu", dtype="bfloat16", n=11008, k=4096, group_size=-1), awq)
    # torch_int_mm is the int8 fallback under the native and oneDNN kernels (test_cpu_int8_gemm.py)
    assert CpuInt8ScaledGemm.supports(dtype="int8", n=64, k=80) is None
    assert "multiple of 16" in CpuInt4GptqGemm.supports(dtype="float32", n=40, k=256, group_size=128)
    assert "not a multiple of 32" in CpuInt4AwqGemm.supports(dtype="float32", n=64, k=256, group_size=16)
    assert "not a multiple of 32" in CpuInt4GptqGemm.supports(dtype="float32", n=64, k=200, group_size=-1)
    # what torch's op cannot take falls back to the native kernel, else the reference
    expected = "cpu_native" if native else "torch"
    assert resolve_kernel("gptq_gemm", "cpu", dtype="float32", n=64, k=256, group_size=16).name == expected


def test_prepare_rejects_mismatched_shapes():
    (q, zeros, scales), _ = _quantized(128, 64, 64, seed=5)
    qweight, qzeros, scales = packing.pack_gptq(q, zeros, scales)
    with pytest.raises(ValueError, match="scales"):
        CpuInt4GptqGemm().prepare_weight((qweight, qzeros, scales[:, :32], None, 64))
    with pytest.raises(ValueError, match="g_idx"):
        CpuInt4GptqGemm().prepare_weight((qweight, qzeros, scales, torch.zeros(64, dtype=torch.int32), 64))


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("m", [0, 1, 7, 64])
def test_int8_scaled_gemm_is_bitwise_the_reference(m, per_token, out_dtype):
    g = torch.Generator().manual_seed(m)
    n, k = 48, 80
    a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale_a = torch.rand(m, 1, generator=g) * 1e-2 if per_token else torch.tensor([1e-2])
    scale_b = torch.rand(n, 1, generator=g) * 1e-2 if per_token else torch.tensor([2e-2])
    for bias in (None, torch.randn(n, generator=g).to(out_dtype)):
        want = TorchInt8ScaledGemm()(a, b, scale_a, scale_b, out_dtype, bias)
        got = CpuInt8ScaledGemm()(a, b, scale_a, scale_b, out_dtype, bias)
        assert got.dtype == out_dtype and torch.equal(got, want)
