"""GGUF blocks in torch (kernels/gguf_blocks.py): the dequantizers against the gguf package's own
(``gguf.quants.dequantize``), exactly, for every type; the ``gguf_gemm`` torch reference against numpy; and
the errors for a wrong type or row size."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from halserve.kernels.gguf_blocks import GGUF_BLOCKS, dequantize, random_blocks, row_bytes
from halserve.kernels.reference import TorchGgufGemm

gguf = pytest.importorskip("gguf", reason="checking against the gguf package needs it (pip install 'halserve[gguf]')")


@pytest.mark.parametrize("qtype", list(GGUF_BLOCKS))
def test_dequantize_matches_the_gguf_package_exactly(qtype):
    block = GGUF_BLOCKS[qtype][0]
    for n, k in ((1, block), (7, 3 * block)):
        w = random_blocks(qtype, n, k, torch.Generator().manual_seed(n))
        ours = dequantize(w, qtype, k)
        theirs = gguf.quants.dequantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
        assert ours.shape == (n, k)
        np.testing.assert_array_equal(ours.numpy(), theirs)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_dequantize_matches_on_blocks_the_gguf_package_quantized(qtype):
    values = np.random.default_rng(0).standard_normal((5, 128)).astype(np.float32)
    qtype_enum = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(values, qtype_enum)
    ours = dequantize(torch.from_numpy(raw), qtype, 128).numpy()
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, qtype_enum))
    assert np.abs(ours - values).max() < 0.5  # and it is the data, quantized


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", list(GGUF_BLOCKS))
def test_torch_reference_is_dequantize_then_matmul(qtype, dtype):
    g = torch.Generator().manual_seed(1)
    k = GGUF_BLOCKS[qtype][0] * 2
    w = random_blocks(qtype, 9, k, g)
    x = torch.randn(3, k, generator=g).to(dtype)
    bias = torch.randn(9, generator=g).to(dtype)
    got = TorchGgufGemm()(x, w, qtype, bias)
    dense = gguf.quants.dequantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
    want = x.float().numpy() @ dense.T + bias.float().numpy()
    assert got.dtype == dtype and got.shape == (3, 9)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    np.testing.assert_allclose(got.float().numpy(), want, rtol=tol, atol=tol * np.abs(want).max())


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="Q2_K.*supported: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K"):
        row_bytes("Q2_K", 256)
    with pytest.raises(ValueError, match="256 values per block.*100 values"):
        row_bytes("Q4_K", 100)
    with pytest.raises(ValueError, match=r"uint8 \[N, 20\]"):
        dequantize(torch.zeros(2, 18, dtype=torch.uint8), "Q4_1", 32)
