"""Rotary tables against transformers' own rotary embedding, bit for bit in fp32."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.layers import ModelContext, get_rope
from halserve.layers.rotary import rope_parameters_from_config

CTX = ModelContext("cpu", torch.float32, TorchAttentionBackend)

SCALINGS = [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 16, "beta_slow": 2,
     "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 128},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["rope_type"])
def test_cos_sin_cache_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=1024,
                         rope_parameters={"rope_theta": 50000.0, **scaling})
    rope = get_rope(config, 64, CTX)
    positions = torch.arange(1024)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    assert rope.cos_sin_cache.shape == (1024, 64)
    assert torch.equal(rope.cos_sin_cache[:, :32], cos[0, :, :32])
    assert torch.equal(rope.cos_sin_cache[:, 32:], sin[0, :, :32])


def test_rotation_matches_transformers_apply():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=256)
    rope = get_rope(config, 32, CTX)
    positions = torch.tensor([5, 0, 200, 17])
    q, k = torch.randn(4, 4 * 32), torch.randn(4, 2 * 32)
    got_q, got_k = rope(positions, q, k)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q.view(1, 4, 4, 32).transpose(1, 2), k.view(1, 4, 2, 32).transpose(1, 2),
                                          cos, sin)
    assert torch.equal(got_q.view(4, 4, 32), want_q.transpose(1, 2)[0])
    assert torch.equal(got_k.view(4, 2, 32), want_k.transpose(1, 2)[0])


def test_legacy_rope_scaling_config():
    """Older checkpoints: rope_scaling with "type" plus a top-level rope_theta."""
    legacy = SimpleNamespace(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=500000.0,
                             max_position_embeddings=64)
    assert rope_parameters_from_config(legacy) == {"type": "linear", "factor": 2.0, "rope_type": "linear",
                                                   "rope_theta": 500000.0}
    plain = SimpleNamespace(rope_scaling=None, max_position_embeddings=64)
    assert rope_parameters_from_config(plain) == {"rope_type": "default", "rope_theta": 10000.0}


def test_unknown_rope_type_is_a_value_error():
    config = SimpleNamespace(rope_parameters={"rope_type": "warp", "rope_theta": 1e4}, max_position_embeddings=64)
    with pytest.raises(ValueError, match="'warp'.*llama3"):
        get_rope(config, 16, CTX)


def test_cache_stays_fp32_when_model_is_cast():
    from transformers import LlamaConfig

    rope = get_rope(LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=32), 16, CTX)
    rope.to(torch.bfloat16)
    assert rope.cos_sin_cache.dtype == torch.float32
