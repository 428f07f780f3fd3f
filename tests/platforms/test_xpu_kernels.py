"""The XPU plugin's IPEX 4-bit GEMM kernels in the default environment (no IPEX installed):
registered, listed, unavailable with a reason, never chosen, IPEX never imported. Their
numerics are tested against IPEX's CPU build in tests/isolated/ipex/test_ipex_wo4_gemm.py."""
from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from halserve.kernels import packing, resolve_kernel
from halserve.platforms import xpu_kernels
from halserve.platforms.cpu_kernels.native_int4 import NativeInt4AwqGemm, NativeInt4GptqGemm
from halserve.platforms.xpu_kernels import IpexAwqGemm, IpexGptqGemm, ipex_unavailable_reason
from halserve.plugins import get_plugin_manager

pytestmark = pytest.mark.skipif(importlib.util.find_spec("intel_extension_for_pytorch") is not None,
                                reason="IPEX is installed here; see tests/isolated/ipex")
PROBLEM = {"dtype": "bfloat16", "n": 4096, "k": 4096, "group_size": 128}


def test_the_xpu_plugin_registers_both_kernels_for_xpu_and_cpu():
    kernels = get_plugin_manager().kernels
    for op, cls in (("awq_gemm", IpexAwqGemm), ("gptq_gemm", IpexGptqGemm)):
        reg = kernels[f"{op}/ipex"]
        assert reg.obj is cls and reg.plugin == "xpu"
        assert cls.runs_on("xpu") and cls.runs_on("cpu") and not cls.runs_on("cuda")
        assert cls.priority > 0
    assert "intel_extension_for_pytorch" not in sys.modules  # discovery imports no IPEX


def test_unavailable_with_the_reason_and_the_next_kernel_resolves():
    for op, cls in (("awq_gemm", IpexAwqGemm), ("gptq_gemm", IpexGptqGemm)):
        reason = cls.supports(**PROBLEM)
        assert reason is not None and "intel_extension_for_pytorch is not installed" in reason
        # xpu: the torch reference; cpu: the cpu plugin's own 4-bit kernels (below IPEX's priority): the
        # native one where this CPU has AVX512-BF16, else torch's int4 kernel
        native = NativeInt4AwqGemm if op == "awq_gemm" else NativeInt4GptqGemm
        best_cpu = "cpu_native" if native.supports(**PROBLEM) is None else "torch_int4pack"
        for platform, name in (("xpu", "torch"), ("cpu", best_cpu)):
            assert resolve_kernel(op, platform, **PROBLEM).name == name
    assert "intel_extension_for_pytorch" not in sys.modules


def test_plugins_report_lists_them_with_the_reason():
    from halserve.entrypoints import cli_plugins

    report = cli_plugins.collect(get_plugin_manager(), "xpu")
    rows = {k["key"]: k for k in report["kernels"]}
    assert rows["awq_gemm/ipex"]["platforms"] == ["xpu", "cpu"]
    assert rows["gptq_gemm/ipex"]["act_order_g_idx"] is True
    for op in ("awq_gemm", "gptq_gemm"):
        assert report["resolved_kernels"][op] == "torch"  # ipex declined, the reference caught it
        (skipped,) = report["kernels_skipped"][op]
        assert skipped.startswith("ipex: intel_extension_for_pytorch is not installed")
    assert "passed over ipex: intel_extension_for_pytorch is not installed" in cli_plugins.render(report)


def test_ipex_built_for_another_torch_is_a_reason(monkeypatch):
    monkeypatch.setattr(xpu_kernels.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(xpu_kernels.importlib.metadata, "version", lambda name: "2.8.0")
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    reason = ipex_unavailable_reason()
    assert reason == "intel_extension_for_pytorch 2.8.0 needs torch 2.8.*, but this is torch 2.13.0"
    monkeypatch.setattr(torch, "__version__", "2.8.0+cpu")
    assert ipex_unavailable_reason() is None
    reason = IpexAwqGemm.supports(**{**PROBLEM, "group_size": 96, "k": 4096})
    assert reason == "K=4096 is not a multiple of group size 96"
    assert "multiple of 8" in IpexGptqGemm.supports(**{**PROBLEM, "n": 4100})


def test_bad_weights_are_value_errors_before_ipex_is_imported():
    q, zeros, scales = packing.quantize_4bit(torch.randn(256, 64), 128)
    qweight, qzeros, s = packing.pack_awq(q, zeros, scales)
    with pytest.raises(ValueError, match=r"qzeros has shape \[1, 8\], expected \[2, 8\]"):
        IpexAwqGemm().prepare_weight((qweight, qzeros[:1], s, 128))
    with pytest.raises(ValueError, match="group_size 96"):
        IpexAwqGemm().prepare_weight((qweight, qzeros, s, 96))
    gq, gz, gs = packing.pack_gptq(q, zeros, scales)
    with pytest.raises(ValueError, match=r"g_idx must be an integer tensor \[K=256\]"):
        IpexGptqGemm().prepare_weight((gq, gz, gs, torch.zeros(128, dtype=torch.int32), 128))
    assert "intel_extension_for_pytorch" not in sys.modules
    with pytest.raises(ImportError):  # valid weights reach the (absent) IPEX import
        IpexAwqGemm().prepare_weight((qweight, qzeros, s, 128))

