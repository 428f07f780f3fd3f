"""``dtype="auto"`` on the CPU computes in the dtype that is fastest on the CPU it runs on: a
bf16 checkpoint stays bf16 only where the CPU has native bf16 dot products."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from halserve.models.loader import resolve_dtype
from halserve.platforms.base import Platform
from halserve.platforms.cpu import CpuPlatform
from halserve.platforms.cpu_kernels import panel


@pytest.fixture
def flags(monkeypatch):
    """Pretend the CPU has exactly the given /proc/cpuinfo flags."""

    def set_flags(*names: str) -> None:
        monkeypatch.setattr(panel, "cpu_flags", lambda: frozenset(("avx2", "fma", *names)))

    return set_flags


def _hf(dtype):
    return SimpleNamespace(torch_dtype=dtype)


def test_bf16_checkpoint_runs_in_float32_without_native_bf16(flags, caplog):
    flags("avx512f")  # AVX-512 but no BF16 dot product
    with caplog.at_level(logging.INFO, logger="halserve.models.loader"):
        assert resolve_dtype("auto", _hf(torch.bfloat16), CpuPlatform) is torch.float32
    assert "no native bfloat16 dot product" in caplog.text
    assert "--dtype bfloat16" in caplog.text  # says how to force it


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_bf16_checkpoint_stays_bf16_with_native_bf16(flags, flag, caplog):
    flags("avx512f", flag)
    with caplog.at_level(logging.INFO, logger="halserve.models.loader"):
        assert resolve_dtype("auto", _hf("bfloat16"), CpuPlatform) is torch.bfloat16
    assert flag in caplog.text


def test_fp16_needs_native_fp16(flags):
    flags("avx512_bf16")
    assert resolve_dtype("auto", _hf(torch.float16), CpuPlatform) is torch.float32
    flags("avx512_fp16")
    assert resolve_dtype("auto", _hf(torch.float16), CpuPlatform) is torch.float16


def test_explicit_dtype_is_kept(flags):
    flags()
    assert resolve_dtype("bfloat16", _hf(torch.bfloat16), CpuPlatform) is torch.bfloat16


def test_float32_and_missing_dtype(flags):
    flags()
    assert resolve_dtype("auto", _hf(torch.float32), CpuPlatform) is torch.float32
    assert resolve_dtype("auto", SimpleNamespace(), CpuPlatform) is torch.float32


def test_base_platform_default_rule():
    class OnlyHalf(Platform):
        name = "only_half"
        supported_dtypes = ("float16", "float32")
        default_dtype = "float16"

    assert OnlyHalf.auto_dtype("bfloat16")[0] == "float16"
    assert OnlyHalf.auto_dtype("float32") == ("float32", "the checkpoint's dtype")
    assert OnlyHalf.auto_dtype(None)[0] == "float16"


def test_cpu_subclass_without_bf16_support_falls_back(flags):
    flags("avx512_bf16")

    class Fp32Only(CpuPlatform):
        supported_dtypes = ("float32",)

    assert Fp32Only.auto_dtype("bfloat16")[0] == "float32"
