"""Which attention backend a model runs with: forced by the config (or
``HALSERVE_ATTENTION_BACKEND``), else the platform's first preferred backend that supports the
model's configuration; the reasons of the skipped ones are logged."""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.models.loader import ModelInfo
    from halserve.platforms.base import Platform

logger = logging.getLogger(__name__)


def select_attention_backend(config: EngineConfig, platform: Platform, info: ModelInfo) -> type:
    """The forced backend (config or HALSERVE_ATTENTION_BACKEND), else the platform's
    first preferred backend that supports this model's configuration."""
    from halserve.plugins import get_plugin_manager

    registry = get_plugin_manager().attention_backends
    dtype = str(info.dtype).replace("torch.", "")
    query = dict(
        dtype=dtype,
        head_size=info.head_size,
        block_size=config.block_size,
        kv_cache_dtype=config.kv_cache_dtype,
        sliding_window=info.sliding_window,
        logits_soft_cap=info.logits_soft_cap,
        num_heads=info.num_heads,
        num_kv_heads=info.num_kv_heads,
    )
    # the KV-cache kinds its layers keep (halserve.kv_cache.spec): a backend must serve each
    from halserve.kv_cache.spec import is_recurrent
    from halserve.models.kv_cache_specs import model_kv_cache_specs

    # (a recurrent layer's state, e.g. Mamba2's, is no backend's: its layer reads and writes its pages itself)
    kinds = sorted({spec.kind for spec in model_kv_cache_specs(info) if not is_recurrent(spec)}
                   - {"full_attention", "sliding_window"})

    def refusal(cls: type) -> str | None:
        missing = [kind for kind in kinds if kind not in cls.kv_cache_spec_kinds()]
        if missing:
            return (f"it does not serve the {', '.join(missing)} KV-cache kind of {info.architecture}'s layers "
                    f"(it serves {', '.join(cls.kv_cache_spec_kinds())})")
        return cls.supports(**query)

    forced = config.attention_backend or os.environ.get("HALSERVE_ATTENTION_BACKEND")
    if forced:
        reg = registry.get(forced)
        if reg is None:
            raise ValueError(f"unknown attention backend {forced!r}; registered: {', '.join(registry.names())}")
        cls = reg.obj
        if not cls.runs_on(platform.name):
            raise ValueError(f"attention backend {forced!r} does not run on platform {platform.name!r} (it runs on {cls.platforms})")
        reason = refusal(cls)
        if reason:
            able = [n for n in platform.preferred_attention_backends
                    if n in registry and refusal(registry[n].obj) is None]
            raise ValueError(f"attention backend {forced!r} cannot run this model: {reason}; on platform "
                             f"{platform.name!r} use one of: {', '.join(able) or 'none'} (or unset attention_backend "
                             "and HALSERVE_ATTENTION_BACKEND to choose automatically)")
        return cls
    reasons = []
    for name in platform.preferred_attention_backends:
        reg = registry.get(name)
        if reg is None:
            reasons.append(f"{name}: not registered")
            continue
        reason = refusal(reg.obj)
        if reason is None:
            if reasons:
                logger.info("attention backend %s selected; skipped %s", name, "; ".join(reasons))
            return reg.obj
        reasons.append(f"{name}: {reason}")
    raise ValueError(
        f"no attention backend of platform {platform.name!r} supports {query}: " + "; ".join(reasons)
    )
