"""Model definitions (HF-architecture compatible) and the loader.

Architectures are registered by plugins (``halserve_model_architectures``) as dotted
paths, so importing this package imports no model.
"""
from halserve.models.loader import ModelInfo, get_model_info, load_model, resolve_model_path

__all__ = ["ModelInfo", "get_model_info", "load_model", "resolve_model_path"]
