"""Gemma's layers against transformers' own modules: GeluAndMul (the ``gelu_tanh_and_mul`` op and
its torch reference) and GemmaRMSNorm (scale by 1 + w), in float32 and bfloat16."""
from __future__ import annotations

import pytest
import torch

from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.kernels import OPS, kernel_candidates
from halserve.kernels.reference import TorchGeluTanhAndMul
from halserve.layers import GeluAndMul, GemmaRMSNorm, ModelContext

DTYPES = [torch.float32, torch.bfloat16]


def ctx_for(dtype: torch.dtype) -> ModelContext:
    return ModelContext("cpu", dtype, TorchAttentionBackend)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_and_mul_matches_gemma_mlp_activation(dtype):
    from transformers.activations import ACT2FN

    x = torch.randn(5, 2 * 48, generator=torch.Generator().manual_seed(0)).to(dtype)
    want = ACT2FN["gelu_pytorch_tanh"](x[:, :48]) * x[:, 48:]  # HF: act_fn(gate_proj(x)) * up_proj(x)
    torch.testing.assert_close(GeluAndMul(48, ctx_for(dtype))(x), want, atol=0, rtol=0)
    torch.testing.assert_close(TorchGeluTanhAndMul()(x), want, atol=0, rtol=0)


def test_gelu_tanh_and_mul_is_an_op_with_a_reference_on_every_platform():
    assert OPS["gelu_tanh_and_mul"].problem_keys == ("intermediate_size",)
    for platform in ("cpu", "cuda", "rocm", "xpu", "tpu"):
        assert TorchGeluTanhAndMul in kernel_candidates("gelu_tanh_and_mul", platform)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemma_rms_norm_matches_transformers(dtype):
    """The checkpoint's w goes through the weight loader; both call forms match HF's
    Gemma2RMSNorm (and the residual sum is HF's ``residual + hidden`` in the model dtype)."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    gen = torch.Generator().manual_seed(1)
    w = (0.1 * torch.randn(64, generator=gen)).to(dtype)
    hf = Gemma2RMSNorm(64, eps=1e-6).to(dtype)
    hf.weight.data.copy_(w)
    norm = GemmaRMSNorm(64, 1e-6, ctx_for(dtype))
    norm.weight.weight_loader(norm.weight, w)
    x, res = (torch.randn(7, 64, generator=gen).to(dtype) for _ in range(2))
    with torch.no_grad():
        torch.testing.assert_close(norm(x), hf(x), atol=0, rtol=0)
        out, summed = norm(x, res)
        torch.testing.assert_close(summed, res + x, atol=0, rtol=0)
        torch.testing.assert_close(out, hf(res + x), atol=1e-6 if dtype == torch.float32 else 0, rtol=0)


def test_gemma_rms_norm_rejects_a_wrong_shape():
    norm = GemmaRMSNorm(64, 1e-6, ctx_for(torch.float32))
    with pytest.raises(ValueError, match=r"shape \(32,\), expected \(64,\)"):
        norm.weight.weight_loader(norm.weight, torch.zeros(32))
