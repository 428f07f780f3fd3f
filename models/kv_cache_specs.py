"""Each attention layer's KV-cache spec (``halserve.kv_cache.spec``) from a checkpoint's config.

The engine core (to group the scheduler's block tables) and the model runner (to size and share the
cache tensors) both read it before or without the model; the runner checks that the built model's
layers (``Attention.kv_cache_spec``) agree.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from halserve.kv_cache.spec import KVCacheSpec, MLASpec, spec_for_window

if TYPE_CHECKING:  # pragma: no cover
    from halserve.models.loader import ModelInfo


MAMBA_HYBRID_MODEL_TYPES = ("bamba",)
"""Model types whose decoder mixes Mamba2 layers (a ``MambaSpec`` each) with attention layers."""


def model_kv_cache_specs(info: ModelInfo) -> tuple[KVCacheSpec, ...]:
    """One spec per cached layer of the decoder, in order; () when every layer is full attention
    (DeepSeek-V2/V3 served natively: an ``MLASpec`` per layer; Bamba: a ``MambaSpec`` per Mamba2 layer
    and a full-attention spec per attention layer)."""
    from halserve.models.llama import layer_sliding_windows

    hf_config = info.hf_config
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if getattr(info, "model_impl", "halserve") == "halserve":
        from halserve.models.deepseek import is_deepseek_mla

        if is_deepseek_mla(text_config):  # one latent per position: MLASpec on every layer
            spec = MLASpec(text_config.kv_lora_rank, text_config.qk_rope_head_dim)
            return (spec,) * text_config.num_hidden_layers
        if getattr(text_config, "model_type", None) in MAMBA_HYBRID_MODEL_TYPES:  # Mamba2 layers beside attention
            from halserve.models.bamba import bamba_kv_cache_specs

            return bamba_kv_cache_specs(text_config)
    windows = layer_sliding_windows(text_config)
    if all(w is None for w in windows):
        return ()
    return tuple(spec_for_window(w) for w in windows)
