"""The one place models get their building blocks' classes: the built-in, or the replacement a
platform plugin registered for it (``halserve_layer_overrides``, ``plugins/overrides.py``).

    model __init__ ──ctx.layer(RMSNorm)(hidden, eps, ctx)──> RMSNorm, or the platform's AcmeRMSNorm
    (looked up in a dict resolved once per ModelContext; the step loop calls the built module)

The first time a replacement class is built, a built-in twin is built with the same arguments on
the meta device (no memory) and their parameters compared: names and shapes must match, so the
checkpoint loads into the replacement unchanged (``LayerOverrideError`` naming the plugin if not).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")

_checked: set[type] = set()  # replacement classes whose parameters matched their built-in's once


def layer_overrides(platform: str) -> dict[type, tuple[type, str]]:
    """``{built-in: (replacement, plugin)}`` for ``platform``."""
    from halserve.plugins.overrides import layer_overrides_for

    return layer_overrides_for(platform)


def layer_class(base: Callable[..., T], overrides: dict[type, tuple[type, str]]) -> Callable[..., T]:
    """What to call where a model builds ``base``: ``base`` itself when nothing replaces it, else a
    builder of the replacement that checks its first instance against the built-in."""
    entry = overrides.get(base)  # type: ignore[call-overload]
    if entry is None:
        return base
    cls, plugin = entry
    if cls in _checked or not issubclass(cls, torch.nn.Module):
        return cls

    def build(*args: Any, **kwargs: Any) -> T:
        layer = cls(*args, **kwargs)
        if cls not in _checked:
            from halserve.plugins.overrides import check_weight_names

            with torch.device("meta"):
                reference = base(*args, **kwargs)
            check_weight_names(plugin, base, layer, reference)  # type: ignore[arg-type]
            _checked.add(cls)
        return layer

    return build
