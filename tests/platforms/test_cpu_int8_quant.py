"""The cpu platform's native ``scaled_int8_quant`` equals the torch reference bit for bit."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def quant():
    from halserve.kernels import resolve_kernel
    from halserve.platforms.cpu_kernels import toolchain_missing

    if toolchain_missing():
        pytest.skip(toolchain_missing())
    return {dtype: resolve_kernel("scaled_int8_quant", "cpu", dtype=dtype) for dtype in ("float32", "bfloat16")}


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [16, 100, 768])
@pytest.mark.parametrize("m", [0, 1, 7, 64])
def test_cpu_int8_quant_equals_reference(quant, m: int, k: int, dtype: str, static: bool) -> None:
    from halserve.kernels.reference import TorchScaledInt8Quant

    kernel = quant[dtype]
    assert kernel.name == "cpu_fused"
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x = (torch.randn(m, k, generator=gen) * 3).to(getattr(torch, dtype))
    if m > 2:
        x[2] = 0  # an all-zero row: scale 1e-12, q 0
        # ties (a dynamic scale of exactly 1, static 0.05 for 0.025 multiples): round half to even
        x[0] = (torch.arange(k) % 20 - 10 + 0.5) * (0.05 if static else 1.0)
        x[0, 0] = 127
    scale = torch.tensor([0.05]) if static else None
    q, s = kernel(x, scale)
    want_q, want_s = TorchScaledInt8Quant()(x, scale)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert torch.equal(q, want_q) and torch.equal(s, want_s)
