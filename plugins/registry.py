"""One registry per kind of contribution (platforms, kernels, ...)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class PluginConflictError(RuntimeError):
    """Two plugins registered the same name for one kind."""


@dataclass(frozen=True, slots=True)
class Registration(Generic[T]):
    name: str  # unique per kind (for kernels: "<op>/<name>")
    plugin: str  # entry-point name of the plugin that registered it
    obj: T  # a class, or a "module:attr" dotted path for model architectures


class Registry(Generic[T]):
    """Name -> registration for one kind. Registering a taken name is an error."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Registration[T]] = {}

    def add(self, name: str, plugin: str, obj: T) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"plugin {plugin!r} registered a {self.kind} with an invalid name {name!r}")
        existing = self._entries.get(name)
        if existing is not None:
            raise PluginConflictError(
                f"{self.kind} {name!r} is registered by both plugin {existing.plugin!r} and "
                f"plugin {plugin!r}; disable one with HALSERVE_DISABLE_PLUGINS={plugin}"
            )
        self._entries[name] = Registration(name, plugin, obj)

    def get(self, name: str) -> Registration[T] | None:
        return self._entries.get(name)

    def __getitem__(self, name: str) -> Registration[T]:
        entry = self._entries.get(name)
        if entry is None:
            raise KeyError(
                f"no {self.kind} named {name!r}; registered: {sorted(self._entries) or 'none'}"
            )
        return entry

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Registration[T]]:
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        return list(self._entries)

    def by_plugin(self, plugin: str) -> list[Registration[T]]:
        return [e for e in self._entries.values() if e.plugin == plugin]


def describe(obj: Any) -> dict[str, Any]:
    """The JSON-able description a registered class gives of itself (``describe()``)."""
    fn = getattr(obj, "describe", None)
    if callable(fn):
        try:
            return dict(fn())
        except Exception as exc:  # a broken describe() must not break listing
            return {"describe_error": f"{type(exc).__name__}: {exc}"}
    return {}
