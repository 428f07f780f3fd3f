"""The XPU plugin's IPEX 4-bit weight-only GEMMs (``awq_gemm/ipex``, ``gptq_gemm/ipex``) on
IPEX's CPU build against the torch reference of the same op. Runs inside the ipex venv.

Weights are random nibbles (every q and zero value 0..15 occurs; GPTQ zeros 1..16, so
the zero-16 correction is exercised), scales random, in AutoAWQ and GPTQ v1 packing.

Tolerance: max |kernel - reference| / max |reference|. The kernel asks IPEX for
``lowp_mode=NONE``, i.e. to compute in the activation dtype, while the reference
dequantizes to float32, multiplies in float32 and rounds once; so the gap is the
activation dtype's rounding of the dequantized weight and the accumulation:
float32 1e-5, float16 3e-3, bfloat16 2e-2 (measured maxima ~1e-6, ~7e-4, ~7e-3).
"""
from __future__ import annotations

import json
import subprocess
import sys
import zlib

import pytest
import torch

from halserve.kernels import packing, resolve_kernel
from halserve.kernels.reference import TorchAwqGemm, TorchGptqGemm
from halserve.platforms.xpu_kernels import IpexAwqGemm, IpexGptqGemm, IpexWoqWeight

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
SHAPES = [(1, 64, 256), (7, 96, 512), (33, 256, 384), (4, 40, 256)]  # (M, N, K); N=40: IPEX needs padding


def _random_weight(fmt: str, k: int, n: int, group_size: int, dtype: torch.dtype, seed: int, act_order: bool = False):
    g = torch.Generator().manual_seed(seed)
    rows = packing.group_rows(k, group_size)
    q = torch.randint(0, 16, (k, n), generator=g)
    scales = torch.rand(k // rows, n, generator=g) * 0.02 + 0.001
    if fmt == "awq":
        zeros = torch.randint(0, 16, (k // rows, n), generator=g)
        return (*packing.pack_awq(q, zeros, scales, dtype=dtype), group_size)
    zeros = torch.randint(1, 17, (k // rows, n), generator=g)  # v1: 1..16
    g_idx = None
    if act_order:  # desc_act: row k belongs to group g_idx[k], a permutation of k // G
        g_idx = (torch.arange(k) // rows)[torch.randperm(k, generator=g)].to(torch.int32)
    qweight, qzeros, s = packing.pack_gptq(q, zeros, scales, dtype=dtype)
    return qweight, qzeros, s, g_idx, group_size


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def _check(fmt: str, m: int, weight: tuple, dtype: torch.dtype, seed: int) -> None:
    kernel, reference = (IpexAwqGemm(), TorchAwqGemm()) if fmt == "awq" else (IpexGptqGemm(), TorchGptqGemm())
    k = weight[0].shape[0] if fmt == "awq" else weight[0].shape[0] * 8
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    originals = [t.clone() if isinstance(t, torch.Tensor) else t for t in weight]
    want = reference(x, *weight)
    got = kernel(x, *weight)  # unprepared: the kernel repacks once and caches
    prepared = kernel.prepare_weight(weight)
    got_prepared = kernel(x, prepared)  # what a layer does after load
    assert isinstance(prepared, IpexWoqWeight)
    assert got.shape == want.shape and got.dtype == want.dtype == dtype
    err = _rel_err(got, want)
    print(f"{fmt} M={m} weight {[list(t.shape) for t in weight if isinstance(t, torch.Tensor)]} {dtype}: "
          f"rel err {err:.2e} (tol {TOL[dtype]:.0e})")
    assert err <= TOL[dtype]
    assert torch.equal(got, got_prepared)
    for before, after in zip(originals, weight):  # IPEX transposes scales in place unless given a copy
        assert not isinstance(before, torch.Tensor) or torch.equal(before, after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_matches_reference(fmt, m, n, k, group_size, dtype):
    seed = zlib.crc32(f"{fmt} {m} {n} {k} {group_size}".encode()) % 10_000
    _check(fmt, m, _random_weight(fmt, k, n, group_size, dtype, seed), dtype, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m, n, k", [(1, 64, 512), (9, 40, 256)])
def test_gptq_act_order_g_idx(m, n, k, dtype):
    _check("gptq", m, _random_weight("gptq", k, n, 128, dtype, 11, act_order=True), dtype, 11)


@pytest.mark.parametrize("group_size", [32, 64, 256])
def test_other_group_sizes_including_one_group_of_k(group_size):
    # group_size == K (256): IPEX itself raises IndexError for that; the kernel passes -1
    for fmt in ("awq", "gptq"):
        _check(fmt, 3, _random_weight(fmt, 256, 64, group_size, torch.float32, 5), torch.float32, 5)


def test_gptq_zero_16_is_read_as_16():
    """Stored zero 15 means zero 16 in GPTQ v1 (the op and AutoGPTQ's kernels); IPEX alone
    would read it as 0. Every zero 16 here: the correction must carry the whole layer."""
    k, n = 256, 64
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (k, n), generator=g)
    zeros = torch.full((2, n), 16)
    scales = torch.rand(2, n, generator=g) * 0.02 + 0.001
    weight = (*packing.pack_gptq(q, zeros, scales, dtype=torch.float32), None, 128)
    assert torch.all(weight[1] == -1)  # every nibble 15
    _check("gptq", 5, weight, torch.float32, 3)
    assert IpexGptqGemm().prepare_weight(weight).correction is not None
    symmetric = (*packing.pack_gptq(q, torch.full((2, n), 8), scales), None, 128)
    assert IpexGptqGemm().prepare_weight(symmetric).correction is None  # no zero 16: no extra work


def test_leading_dims_and_empty_batch():
    weight = _random_weight("awq", 256, 64, 128, torch.float32, 9)
    kernel = IpexAwqGemm()
    prepared = kernel.prepare_weight(weight)
    x = torch.randn(2, 3, 256)
    assert torch.allclose(kernel(x, prepared), TorchAwqGemm()(x, *weight), rtol=1e-5, atol=1e-5)
    assert kernel(torch.randn(0, 256), prepared).shape == (0, 64)


def test_unprepared_calls_repack_once_per_weight():
    weight = _random_weight("awq", 256, 64, 128, torch.float32, 4)
    kernel = IpexAwqGemm()
    x = torch.randn(2, 256)
    kernel(x, *weight)
    first = kernel._last[2]
    kernel(x, *weight)
    assert kernel._last[2] is first  # same tensors, unchanged: reused
    weight[2].mul_(2)  # scales changed in place: repacked
    out = kernel(x, *weight)
    assert kernel._last[2] is not first
    assert _rel_err(out, TorchAwqGemm()(x, *weight)) <= TOL[torch.float32]



def test_unprepared_gptq_calls_tell_g_idx_apart():
    qweight, qzeros, scales, g_idx, group_size = _random_weight("gptq", 512, 64, 128, torch.float32, 6, act_order=True)
    kernel, reference = IpexGptqGemm(), TorchGptqGemm()
    x = torch.randn(2, 512)
    for gi in (g_idx, None, g_idx):  # the cache must rebuild on each switch
        got = kernel(x, qweight, qzeros, scales, gi, group_size)
        assert _rel_err(got, reference(x, qweight, qzeros, scales, gi, group_size)) <= TOL[torch.float32]

# -- validation: mistakes are ValueErrors before IPEX sees them --------------------------------


@pytest.mark.parametrize(
    "breakage, match",
    [
        ("qzeros_shape", "qzeros has shape"),
        ("scales_shape", "scales has shape"),
        ("qweight_dtype", "torch.int32"),
        ("group_not_dividing_k", "group_size 96"),
        ("g_idx_range", "g_idx values"),
        ("x_features", "K=256"),
        ("x_dtype", "activations"),
    ],
)
def test_bad_arguments_raise_value_error(breakage, match):
    qweight, qzeros, scales, g_idx, group_size = _random_weight("gptq", 256, 64, 128, torch.float32, 1)
    x = torch.randn(3, 256)
    if breakage == "qzeros_shape":
        qzeros = qzeros[:1]
    elif breakage == "scales_shape":
        scales = scales[:, :32]
    elif breakage == "qweight_dtype":
        qweight = qweight.to(torch.int64)
    elif breakage == "group_not_dividing_k":
        group_size = 96
    elif breakage == "g_idx_range":
        g_idx = torch.full((256,), 5, dtype=torch.int32)
    elif breakage == "x_features":
        x = torch.randn(3, 128)
    elif breakage == "x_dtype":
        x = torch.ones(3, 256, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        IpexGptqGemm()(x, qweight, qzeros, scales, g_idx, group_size)


# -- resolution and the plugin surface ---------------------------------------------------------


def test_resolves_on_cpu_when_ipex_is_installed():
    for op, cls in (("awq_gemm", IpexAwqGemm), ("gptq_gemm", IpexGptqGemm)):
        assert cls.supports(dtype="bfloat16", n=4096, k=4096, group_size=128) is None
        assert isinstance(resolve_kernel(op, "cpu", dtype="float32", n=64, k=256, group_size=-1), cls)
        assert "K=250 is not a multiple of group size 128" in cls.supports(dtype="float32", n=64, k=250, group_size=128)


def _halserve(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "halserve.entrypoints.cli", *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.stdout.strip().startswith("{"), f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-2000:]}"
    return json.loads(proc.stdout)


def test_plugins_json_lists_the_kernels_as_available():
    data = _halserve("plugins", "--json", "--platform", "cpu")
    kernels = {k["key"]: k for k in data["kernels"]}
    for op in ("awq_gemm", "gptq_gemm"):
        row = kernels[f"{op}/ipex"]
        assert row["plugin"] == "xpu"
        assert row["platforms"] == ["xpu", "cpu"]
        assert row["bits"] == 4
        assert data["resolved_kernels"][op] == "ipex", data["resolution_errors"].get(op)


def test_conformance_kit_passes_the_xpu_kernels_on_cpu():
    """The kit's own grid (N=40, group 128 and -1, act-order, M=1..17, three dtypes)."""
    report = _halserve("conformance", "xpu", "--platform", "cpu", "--checks", "kernels", "--json")
    rows = [r for r in report["results"] if r["check"] == "kernel" and r["case"] != "declaration"]
    failed = [f"{r['subject']} {r['case']}: {r['detail']}" for r in rows if r["status"] == "failed"]
    assert not failed, "\n".join(failed)
    passed = {r["subject"] for r in rows if r["status"] == "passed"}
    assert passed == {"awq_gemm/ipex", "gptq_gemm/ipex"}
    assert not [r for r in rows if r["status"] == "declined"]
