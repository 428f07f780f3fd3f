"""Plugin API 2: model-loader formats, what ``--load-format NAME`` picks.

    halserve_load_formats() -> [AcmeBlobFormat]      (LoadFormat subclasses, keyed by ``name``)

halserve's own formats (``auto``, ``safetensors``, ``dummy``; ``halserve.models.loader``) are
reserved names. A plugin's format gets the model already built on its device (parameters allocated,
in the model's dtype) and fills its weights; halserve then checks that every parameter was filled
and runs the quant methods' ``process_weights_after_loading``, as for a safetensors checkpoint.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, cast

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from halserve.config import EngineConfig

BUILTIN_LOAD_FORMATS = ("auto", "safetensors", "dummy")


class LoadFormatError(TypeError):
    """A plugin's load format that is no ``LoadFormat`` subclass or takes a reserved name."""


class LoadFormat:
    """One way to read a model's weights. Subclasses set ``name`` and implement ``iterate_weights``
    (or, for full control, ``load_weights``)."""

    name: ClassVar[str]
    """What ``--load-format`` takes (not one of ``BUILTIN_LOAD_FORMATS``)."""
    description: ClassVar[str] = ""

    def __init__(self, config: EngineConfig) -> None:
        """Made once per model load, by each worker, with the engine's config."""
        self.config = config

    def iterate_weights(self, model_path: str) -> Iterable[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every weight of the checkpoint in ``model_path`` (the ``--model``
        folder), named as in the Hugging Face checkpoint (``model.layers.0.self_attn.q_proj.weight``):
        the model's ``load_weights`` maps, shards and converts them. Called by ``load_weights``."""
        raise NotImplementedError(f"load format {self.name!r} implements neither iterate_weights nor load_weights")

    def load_weights(self, model: torch.nn.Module, model_path: str) -> set[str]:
        """(optional) default: ``model.load_weights(self.iterate_weights(model_path))``. Fill the
        parameters of ``model`` (built on the device, in its dtype) and return the names of those
        filled; a parameter left out is an error naming it, unless it is marked ``optional``."""
        load = cast(Any, model).load_weights  # (halserve's model protocol, not nn.Module's)
        return set(load(self.iterate_weights(model_path)))

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"description": cls.description}


def check_load_format(plugin: str, obj: Any) -> type[LoadFormat]:
    """``obj`` if it is a usable load format class, else ``LoadFormatError`` naming the plugin and why."""
    if not isinstance(obj, type) or not issubclass(obj, LoadFormat):
        raise LoadFormatError(
            f"plugin {plugin!r}: halserve_load_formats returned {obj!r}; return subclasses of "
            "halserve.plugins.LoadFormat (with a name and iterate_weights)"
        )
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not name:
        raise LoadFormatError(f"plugin {plugin!r}: load format {obj.__name__} has no name; set name = 'myformat'")
    if name in BUILTIN_LOAD_FORMATS:
        raise LoadFormatError(
            f"plugin {plugin!r}: load format {obj.__name__} takes the name {name!r}, which is halserve's own "
            f"({', '.join(BUILTIN_LOAD_FORMATS)} are reserved); pick another name"
        )
    if obj.iterate_weights is LoadFormat.iterate_weights and obj.load_weights is LoadFormat.load_weights:
        raise LoadFormatError(
            f"plugin {plugin!r}: load format {name!r} ({obj.__name__}) implements neither iterate_weights "
            "nor load_weights; implement iterate_weights(model_path) yielding (name, tensor)"
        )
    return obj


def load_format_names() -> list[str]:
    """halserve's formats, then every plugin's (what ``--load-format`` accepts)."""
    import halserve.plugins as plugins

    registry = getattr(plugins.get_plugin_manager(), "load_formats", None) or ()
    return [*BUILTIN_LOAD_FORMATS, *(reg.name for reg in registry)]


def check_load_format_name(name: str) -> str:
    """``name`` if ``--load-format`` accepts it, else a ValueError listing the formats there are."""
    if name in BUILTIN_LOAD_FORMATS:
        return name
    names = load_format_names()
    if name not in names:
        raise ValueError(
            f"load_format {name!r} is not supported; use one of {', '.join(names)} (halserve's own and those "
            "registered by plugins through halserve_load_formats; `halserve plugins` lists them)"
        )
    return name


def get_load_format(name: str) -> type[LoadFormat]:
    """The class of a plugin's load format ``name`` (``check_load_format_name`` first)."""
    import halserve.plugins as plugins

    check_load_format_name(name)
    return plugins.get_plugin_manager().load_formats[name].obj


__all__ = [
    "BUILTIN_LOAD_FORMATS",
    "LoadFormat",
    "LoadFormatError",
    "check_load_format",
    "check_load_format_name",
    "get_load_format",
    "load_format_names",
]
