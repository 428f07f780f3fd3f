"""Each attention layer's KV-cache spec (``halserve.kv_cache.spec``) from a checkpoint's config.

The engine core (to group the scheduler's block tables) and the model runner (to size and share the
cache tensors) both read it before or without the model; the runner checks that the built model's
layers (``Attention.kv_cache_spec``) agree.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from halserve.kv_cache.spec import KVCacheSpec, spec_for_window

if TYPE_CHECKING:  # pragma: no cover
    from halserve.models.loader import ModelInfo


def model_kv_cache_specs(info: ModelInfo) -> tuple[KVCacheSpec, ...]:
    """One spec per attention layer of the decoder, in order; () when every layer is full attention."""
    from halserve.models.llama import layer_sliding_windows

    hf_config = info.hf_config
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    windows = layer_sliding_windows(text_config)
    if all(w is None for w in windows):
        return ()
    return tuple(spec_for_window(w) for w in windows)
