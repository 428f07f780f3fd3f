"""Model definitions (HF-architecture compatible), what the engine needs of them, and the loader.

Architectures are registered by plugins (``halserve_model_architectures``) as dotted paths or
classes, so importing this package imports no model. Each registration goes through
``check_architecture`` (``halserve.models.interfaces``): a class when registered, a dotted path when
``architecture_class`` first imports it.
"""
from __future__ import annotations

import importlib

from halserve.models.interfaces import (
    ModelModule,
    SequenceClassificationModel,
    SupportsMRoPE,
    SupportsMultiModal,
    SupportsPipelineParallel,
    TextGenerationModel,
    check_architecture,
    is_sequence_classifier,
    supports_multimodal,
    supports_pipeline_parallel,
    uses_mrope,
)
from halserve.models.loader import ModelInfo, get_model_info, load_model, resolve_model_path

__all__ = [
    "ModelInfo",
    "ModelModule",
    "SequenceClassificationModel",
    "SupportsMRoPE",
    "SupportsMultiModal",
    "SupportsPipelineParallel",
    "TextGenerationModel",
    "architecture_class",
    "check_architecture",
    "get_model_info",
    "is_sequence_classifier",
    "load_model",
    "resolve_model_path",
    "supported_architectures",
    "supports_multimodal",
    "supports_pipeline_parallel",
    "uses_mrope",
]


def supported_architectures() -> dict[str, str | type]:
    """Architecture name -> its registered class or ``"module.path:ClassName"`` (every loaded plugin's)."""
    from halserve.plugins import get_plugin_manager

    return {r.name: r.obj for r in get_plugin_manager().models}


def architecture_class(architecture: str, platform: str | None = None) -> type[ModelModule]:
    """The registered class of ``architecture``, imported and checked against its protocols
    (ValueError naming the class and the missing member). On ``platform``, the variant a plugin
    declared for it there (``ModelArchitecture(..., platform=, override=True)``, plugin API 2)."""
    from halserve.plugins.overrides import model_variant_for

    variant = model_variant_for(architecture, platform)
    target = supported_architectures().get(architecture) if variant is None else variant.obj.target
    if target is None:
        raise ValueError(f"architecture {architecture!r} is not registered; registered: "
                         f"{', '.join(sorted(supported_architectures())) or 'none'}")
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        try:
            target = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"architecture {architecture!r} is registered as {target!r}, which cannot be "
                             f"imported ({type(exc).__name__}: {exc})") from exc
    check_architecture(architecture, target)
    return target  # type: ignore[return-value]  (checked above)
