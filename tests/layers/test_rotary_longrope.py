"""LongRoPE (Phi-3) and partial rotary tables against transformers' Phi3RotaryEmbedding, bit for
bit in fp32, on each side of original_max_position_embeddings; malformed factor lists."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.layers import ModelContext, get_rope

HEADS, HIDDEN, MAX_POS, ORIGINAL_MAX = 4, 128, 256, 32  # head_size 32


def phi3_config(partial_rotary_factor: float = 1.0, **rope_extra):
    from transformers import Phi3Config

    half = int(HIDDEN // HEADS * partial_rotary_factor) // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.0 + 3.0 * i for i in range(half)], **rope_extra}
    return Phi3Config(hidden_size=HIDDEN, num_attention_heads=HEADS, max_position_embeddings=MAX_POS,
                      original_max_position_embeddings=ORIGINAL_MAX, rope_parameters=rope,
                      partial_rotary_factor=partial_rotary_factor, pad_token_id=0, eos_token_id=2)


def hf_cos_sin(config, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's [P, R/2] cos and sin for one call over positions 0..P-1 (which picks its factor set)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1), torch.arange(num_positions)[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


def rope_for(config, max_model_len: int):
    return get_rope(config, HIDDEN // HEADS, ModelContext("cpu", torch.float32, TorchAttentionBackend,
                                                          max_position=max_model_len))


@pytest.mark.parametrize("rope_extra", [{}, {"attention_factor": 0.9}, {"factor": 2.0}],
                         ids=["implied_factors", "attention_factor", "factor"])
@pytest.mark.parametrize("partial_rotary_factor", [1.0, 0.75])
def test_short_factors_when_max_model_len_fits_the_original_window(rope_extra, partial_rotary_factor):
    config = phi3_config(partial_rotary_factor, **rope_extra)
    rope = rope_for(config, ORIGINAL_MAX)
    cos, sin = hf_cos_sin(config, ORIGINAL_MAX)  # HF: short factors up to the original max
    half = cos.shape[-1]
    assert half == int(32 * partial_rotary_factor) // 2 and rope.rotary_dim == 2 * half
    assert torch.equal(rope.cos_sin_cache[:ORIGINAL_MAX, :half], cos)
    assert torch.equal(rope.cos_sin_cache[:ORIGINAL_MAX, half:], sin)


@pytest.mark.parametrize("rope_extra", [{}, {"attention_factor": 0.9}], ids=["implied_factors", "attention_factor"])
@pytest.mark.parametrize("partial_rotary_factor", [1.0, 0.75])
def test_long_factors_for_every_position_when_max_model_len_exceeds_it(rope_extra, partial_rotary_factor):
    """HF uses the long factors for a whole call once it reaches past the original max; halserve
    does for every position when it may serve sequences that long (see _longrope_inv_freq)."""
    config = phi3_config(partial_rotary_factor, **rope_extra)
    rope = rope_for(config, MAX_POS)
    cos, sin = hf_cos_sin(config, MAX_POS)
    half = cos.shape[-1]
    assert rope.cos_sin_cache.shape == (MAX_POS, 2 * half)
    assert torch.equal(rope.cos_sin_cache[:, :half], cos)
    assert torch.equal(rope.cos_sin_cache[:, half:], sin)
    short_cos, _ = hf_cos_sin(config, ORIGINAL_MAX)
    assert not torch.equal(rope.cos_sin_cache[:ORIGINAL_MAX, :half], short_cos)  # HF would differ here


def test_su_is_read_as_longrope():
    """The first Phi-3 configs (v4 style: rope_scaling with "su", top-level rope_theta and
    original_max_position_embeddings), as a remote-code config object carries them."""
    config = phi3_config()
    legacy = SimpleNamespace(
        rope_scaling={"type": "su", "short_factor": config.rope_parameters["short_factor"],
                      "long_factor": config.rope_parameters["long_factor"]},
        rope_theta=10000.0, max_position_embeddings=MAX_POS, original_max_position_embeddings=ORIGINAL_MAX,
    )
    for max_model_len in (ORIGINAL_MAX, MAX_POS):
        assert torch.equal(rope_for(legacy, max_model_len).cos_sin_cache, rope_for(config, max_model_len).cos_sin_cache)


def legacy_longrope(short_factor, long_factor) -> SimpleNamespace:
    """A config transformers did not validate (remote code, v4 style): halserve checks it itself."""
    return SimpleNamespace(
        rope_scaling={"type": "longrope", "short_factor": short_factor, "long_factor": long_factor},
        rope_theta=10000.0, max_position_embeddings=MAX_POS, original_max_position_embeddings=ORIGINAL_MAX,
    )


def test_factor_list_of_wrong_length_names_the_field_and_the_length():
    with pytest.raises(ValueError, match=r"rope_parameters\['long_factor'\] has 15 entries.*rotary_dim / 2 = 16"):
        rope_for(legacy_longrope([1.0] * 16, [1.0] * 15), MAX_POS)
    with pytest.raises(ValueError, match=r"rope_parameters\['short_factor'\] has 17 entries"):
        rope_for(legacy_longrope([1.0] * 17, [1.0] * 16), ORIGINAL_MAX)


def test_missing_or_non_numeric_factors_are_refused():
    with pytest.raises(ValueError, match=r"'longrope' \(LongRoPE\) needs rope_parameters\['long_factor'\]"):
        rope_for(legacy_longrope([1.0] * 16, None), MAX_POS)
    with pytest.raises(ValueError, match=r"rope_parameters\['short_factor'\] must be a list of numbers"):
        rope_for(legacy_longrope("1.0", [1.0] * 16), MAX_POS)
