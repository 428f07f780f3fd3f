"""AWQ / GPTQ packing: round trips, the documented nibble orders, and the reference GEMMs."""
import pytest
import torch

from halserve.kernels import packing
from halserve.kernels.reference import TorchAwqGemm, TorchGptqGemm


def test_awq_nibble_order_is_autoawq():
    # logical columns 0..7 with values 0..7: nibble i must hold column AWQ_ORDER[i]
    q = torch.arange(8, dtype=torch.int32).reshape(1, 8)
    qweight = packing._pack_nibbles(packing._awq_permute(q), dim=1)
    nibbles = [(int(qweight) >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [0, 2, 4, 6, 1, 3, 5, 7]


def test_gptq_packs_along_k_with_zero_minus_one():
    q = torch.arange(8, dtype=torch.int32).reshape(8, 1).repeat(1, 8)  # row k has value k
    zeros = torch.full((1, 8), 8, dtype=torch.int32)
    qweight, qzeros, _ = packing.pack_gptq(q, zeros, torch.ones(1, 8))
    assert [(int(qweight[0, 0]) >> (4 * i)) & 0xF for i in range(8)] == list(range(8))
    assert int(qzeros[0, 0]) == 0x77777777  # 8 - 1 in every nibble
    with pytest.raises(ValueError, match="1..16"):
        packing.pack_gptq(q, torch.zeros(1, 8, dtype=torch.int32), torch.ones(1, 8))


@pytest.mark.parametrize("group_size", [32, -1])
def test_round_trips(group_size):
    w = torch.randn(64, 16)
    q, zeros, scales = packing.quantize_4bit(w, group_size)
    g = 64 if group_size == -1 else group_size
    approx = (q - zeros.repeat_interleave(g, 0)) * scales.repeat_interleave(g, 0)
    assert (approx - w).abs().max() <= scales.max() * 0.51  # round to nearest
    qw, qz, s = packing.pack_awq(q, zeros, scales, dtype=torch.float32)
    assert qw.shape == (64, 2) and qz.shape == (64 // g, 2)
    assert torch.equal(packing.dequantize_awq(qw, qz, s, group_size), approx)
    qw, qz, s = packing.pack_gptq(q, zeros, scales, dtype=torch.float32)
    assert qw.shape == (8, 16) and qz.shape == (64 // g, 2)
    assert torch.equal(packing.dequantize_gptq(qw, qz, s, None, group_size), approx)


def test_gptq_act_order_g_idx():
    w = torch.randn(64, 8)
    q, zeros, scales = packing.quantize_4bit(w, 16)
    perm = torch.randperm(64)
    g_idx = (torch.arange(64) // 16)[perm]  # rows permuted: group of row k is g_idx[k]
    qw, qz, s = packing.pack_gptq(q, zeros, scales, dtype=torch.float32)
    deq = packing.dequantize_gptq(qw, qz, s, g_idx, 16)
    assert torch.equal(deq, (q - zeros[g_idx]) * scales[g_idx])


def test_reference_gemms_match_dequantized_matmul():
    w = torch.randn(128, 32)
    x = torch.randn(3, 128)
    q, zeros, scales = packing.quantize_4bit(w, 64)
    qw, qz, s = packing.pack_awq(q, zeros, scales, dtype=torch.float32)
    out = TorchAwqGemm()(x, qw, qz, s, 64)
    torch.testing.assert_close(out, x @ packing.dequantize_awq(qw, qz, s, 64))
    assert (out - x @ w).norm() < 0.2 * (x @ w).norm()  # and it is a 4-bit approximation of w
    qw, qz, s = packing.pack_gptq(q, zeros, scales, dtype=torch.float32)
    torch.testing.assert_close(TorchGptqGemm()(x, qw, qz, s, None, 64), out)
