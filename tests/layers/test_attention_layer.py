"""The Attention layer and the forward context it reads."""
from __future__ import annotations

import pytest
import torch

from halserve.attention_backends.base import AttentionMetadata
from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.forward_context import get_forward_context, set_forward_context
from halserve.layers import Attention, ModelContext

CTX = ModelContext("cpu", torch.float32, TorchAttentionBackend, kv_cache_dtype="fp8")


def test_forward_context_nests_and_requires_a_scope():
    with pytest.raises(RuntimeError, match="set_forward_context"):
        get_forward_context()
    with set_forward_context("outer"):
        with set_forward_context(None):
            assert get_forward_context().attn_metadata is None
        assert get_forward_context().attn_metadata == "outer"


def test_layer_builds_its_backend_and_passes_scales():
    attn = Attention(4, 8, 0.35, 2, CTX, sliding_window=5, prefix="layers.0.attn")
    assert isinstance(attn.backend, TorchAttentionBackend)
    assert (attn.backend.sliding_window, attn.backend.kv_cache_dtype, attn.backend.scale) == (5, "fp8", 0.35)
    q, k, v = torch.randn(3, 32), torch.randn(3, 16), torch.randn(3, 16)
    with set_forward_context(None):  # dummy run: no cache needed, zeros out
        assert torch.equal(attn(q, k, v), torch.zeros(3, 32))
    starts, lens = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    meta = TorchAttentionBackend.build_metadata(AttentionMetadata(
        num_actual_tokens=3, num_reqs=1, max_query_len=3, max_seq_len=3, query_start_loc=starts, seq_lens=lens,
        block_table=torch.tensor([[0]], dtype=torch.int32), slot_mapping=torch.arange(3),
        query_start_loc_cpu=starts, seq_lens_cpu=lens))
    with set_forward_context(meta), pytest.raises(RuntimeError, match="layers.0.attn.*kv_cache"):
        attn(q, k, v)
    attn.kv_cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(1, 4, 2, 8), dtype=torch.float8_e4m3fn)
    attn.k_scale, attn.v_scale = 0.5, 2.0
    with set_forward_context(meta):
        out = attn(q, k, v)
    assert out.shape == (3, 32)
    # the cache holds k / k_scale in fp8
    torch.testing.assert_close(attn.kv_cache[0, 0, :3].float().view(3, 16), k / 0.5, atol=0.1, rtol=0.07)
