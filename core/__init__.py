"""halserve: LLM serving on any accelerator through plugins.

``import halserve`` is cheap: it imports no vendor library, no server stack and does not
touch a device. The public names load on first use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "halserve.entrypoints.llm",
    "SamplingParams": "halserve.sampling_params",
    "BeamSearchParams": "halserve.beam_search",
    "PoolingParams": "halserve.pooling_params",
    "PoolerConfig": "halserve.pooler_config",
    "EmbeddingRequestOutput": "halserve.outputs",
    "ClassificationRequestOutput": "halserve.outputs",
    "ScoringRequestOutput": "halserve.outputs",
    "RequestOutput": "halserve.outputs",
    "CompletionOutput": "halserve.outputs",
    "LLMEngine": "halserve.engine.llm_engine",
    "EngineConfig": "halserve.config",
    "LoRARequest": "halserve.lora.request",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:  # pragma: no cover
    from halserve.beam_search import BeamSearchParams
    from halserve.config import EngineConfig
    from halserve.engine.llm_engine import LLMEngine
    from halserve.entrypoints.llm import LLM
    from halserve.lora.request import LoRARequest
    from halserve.outputs import (
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from halserve.pooler_config import PoolerConfig
    from halserve.pooling_params import PoolingParams
    from halserve.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'halserve' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
