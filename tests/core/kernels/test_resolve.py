"""Kernel resolution: the best kernel that supports a problem, and HALSERVE_KERNELS pins."""
from __future__ import annotations

import pytest

from halserve.kernels import resolve_kernel
from halserve.kernels.resolve import KernelNotFoundError

PROBLEM = dict(dtype="float32", n=64, k=256, group_size=128)


def test_the_cpu_int4_kernel_wins_and_a_pin_picks_the_reference(monkeypatch):
    from halserve.platforms.cpu_kernels.native_int4 import NativeInt4GptqGemm

    # the native kernel where this CPU has AVX512-BF16, else torch's int4 kernel
    best = "cpu_native" if NativeInt4GptqGemm.supports(**PROBLEM) is None else "torch_int4pack"
    assert resolve_kernel("gptq_gemm", "cpu", **PROBLEM).name == best
    monkeypatch.setenv("HALSERVE_KERNELS", " gptq_gemm = torch , awq_gemm=torch")
    assert resolve_kernel("gptq_gemm", "cpu", **PROBLEM).name == "torch"
    assert resolve_kernel("awq_gemm", "cpu", **PROBLEM).name == "torch"
    assert resolve_kernel("gemm", "cpu", dtype="float32", n=64, k=64).name == "onednn"  # not pinned


def test_bad_pins_are_errors(monkeypatch):
    monkeypatch.setenv("HALSERVE_KERNELS", "gptq_gemm=triton_cuda")
    with pytest.raises(KernelNotFoundError, match="pins op 'gptq_gemm' to kernel 'triton_cuda', which is not "
                                                  "registered for platform 'cpu' \\(its kernels: .*torch_int4pack"):
        resolve_kernel("gptq_gemm", "cpu", **PROBLEM)
    monkeypatch.setenv("HALSERVE_KERNELS", "gptq_gemm=torch_int4pack")
    with pytest.raises(KernelNotFoundError, match="pinned by HALSERVE_KERNELS.*torch_int4pack: "):
        resolve_kernel("gptq_gemm", "cpu", dtype="float32", n=40, k=256, group_size=128)  # N not a multiple of 16
    for bad, message in (("gptq_gemm", "must be op=kernel"), ("no_such_op=torch", "unknown op 'no_such_op'")):
        monkeypatch.setenv("HALSERVE_KERNELS", bad)
        with pytest.raises(ValueError, match=message):
            resolve_kernel("gemm", "cpu", dtype="float32", n=64, k=64)
