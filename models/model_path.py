"""Is a model argument a local path or a Hugging Face hub id? A missing local path is a file-system
error that names it, never the hub's "repo id must be in the form 'namespace/repo_name'" error.

    /data/llama, ./llama, ../llama, ~/llama   a path: it must exist
    models/llama  (./models is a folder)      a path: its parent exists, so it must too
    Qwen/Qwen2.5-0.5B-Instruct                a hub id (no folder ./Qwen)
"""
from __future__ import annotations

import os

__all__ = ["ModelPathNotFoundError", "check_local_path", "looks_like_local_path"]

_PATH_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")


class ModelPathNotFoundError(FileNotFoundError, ValueError):
    """A model argument that names a local path which does not exist (a ``ValueError`` too, so callers
    that report bad configuration report it as such)."""


def looks_like_local_path(model: str) -> bool:
    """``model`` is meant as a file or folder on this machine: it starts with ``/``, ``./``, ``../`` or
    ``~``, or its parent folder exists here."""
    if model.startswith(_PATH_PREFIXES) or model in (".", ".."):
        return True
    parent = os.path.dirname(model)
    return bool(parent) and os.path.isdir(os.path.expanduser(parent))


def check_local_path(model: str, what: str = "model") -> None:
    """``ModelPathNotFoundError`` if ``model`` looks like a local path (``looks_like_local_path``) that
    does not exist; a hub id or an existing path passes."""
    if looks_like_local_path(model) and not os.path.exists(os.path.expanduser(model)):
        raise ModelPathNotFoundError(
            f"no such file or directory: {model} (the {what} argument is a local path, so it is not looked "
            "up on the Hugging Face hub; check the path)")
