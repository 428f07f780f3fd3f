"""Which KV-cache spec kinds exist: halserve's own (``spec.KVCacheSpec``) and those plugins register.

A *kind* names what a layer keeps in the pool (``spec.kind``: ``full_attention``, ``sliding_window``,
``mla``, ...). An attention backend declares the kinds whose layers it serves
(``AttentionBackend.kv_cache_spec_kinds``); the model runner refuses a backend for a layer whose kind it
does not claim, and the conformance kit checks every kind a backend claims (docs/plugins.md).

A plugin that brings a new kind of layer state registers its spec class once per process, from the
hook that returns the backend serving it (hooks run once, at discovery)::

    @dataclass(frozen=True, slots=True)
    class ChunkedLocalSpec:                      # what a layer of this kind keeps
        chunk: int
        kind: ClassVar[str] = "acme_chunked_local"
        def num_skipped_tokens(self, num_computed_tokens): ...          # blocks no later query reads
        def max_num_blocks(self, num_tokens, block_size, max_step_tokens): ...

    @hookimpl
    def halserve_attention_backends():
        register_spec_kind(ChunkedLocalSpec, plugin="acme", conformance=check_chunked_local)
        return [AcmeAttentionBackend]            # kv_cache_spec_kinds() -> (..., "acme_chunked_local")

``conformance(backend_cls, device) -> str`` (optional) is what the kit runs for each backend claiming
the kind: a forward of that kind against the plugin's own reference, raising ``AssertionError`` on a
mismatch and returning a one-line summary; a kind registered without one is reported ``warned``.
"""
from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass

from halserve.kv_cache.spec import KVCacheSpec

SPEC_METHODS = ("num_skipped_tokens", "max_num_blocks")
"""What the KV-cache manager calls on every spec (``spec.FullAttentionSpec`` documents them)."""


@dataclass(frozen=True, slots=True)
class SpecKind:
    """One registered kind."""

    name: str  # the spec class's ``kind``
    spec_cls: type  # a frozen (hashable) dataclass with SPEC_METHODS
    plugin: str | None  # who registered it; None for halserve's own
    conformance: Callable[[type, str], str] | None = None  # (backend class, device) -> summary; see module doc


_REGISTERED: dict[str, SpecKind] = {}  # the plugins' kinds, by name


def builtin_spec_kinds() -> dict[str, SpecKind]:
    """halserve's own kinds: the classes of the ``KVCacheSpec`` union (their checks live in the kit)."""
    return {cls.kind: SpecKind(cls.kind, cls, None) for cls in typing.get_args(KVCacheSpec)}


def known_spec_kinds() -> dict[str, SpecKind]:
    """Every kind this process knows: halserve's own, then the plugins' in registration order."""
    return {**builtin_spec_kinds(), **_REGISTERED}


def register_spec_kind(spec_cls: type, *, plugin: str,
                       conformance: Callable[[type, str], str] | None = None) -> SpecKind:
    """Make ``spec_cls.kind`` a known KV-cache spec kind (see the module docstring).

    Registering the same class again (a second discovery in one process) returns the first
    registration. A kind halserve or another class already uses, a class that is not hashable (specs
    key the layer groups) or that lacks ``kind`` or a manager method is a ``ValueError`` naming it."""
    name = getattr(spec_cls, "kind", None)
    where = f"plugin {plugin!r}: KV-cache spec class {getattr(spec_cls, '__qualname__', spec_cls)!r}"
    if not isinstance(spec_cls, type) or not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{where} needs a class attribute kind = '<identifier>' (e.g. 'acme_chunked_local'), "
                         f"got {name!r}")
    missing = [m for m in SPEC_METHODS if not callable(getattr(spec_cls, m, None))]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)} (the KV-cache manager calls them; see "
                         "halserve.kv_cache.spec.FullAttentionSpec)")
    if spec_cls.__hash__ is None:
        raise ValueError(f"{where} is not hashable; declare it @dataclass(frozen=True)")
    if conformance is not None and not callable(conformance):
        raise ValueError(f"{where}: conformance must be a callable (backend_cls, device) -> str, got {conformance!r}")
    builtin = builtin_spec_kinds()
    if name in builtin:
        raise ValueError(f"{where} takes the kind {name!r}, one of halserve's own ({', '.join(builtin)}); "
                         "name yours after your plugin")
    existing = _REGISTERED.get(name)
    if existing is not None:
        if existing.spec_cls is spec_cls:
            return existing
        raise ValueError(f"{where} takes the kind {name!r}, already registered by plugin {existing.plugin!r} "
                         f"for {existing.spec_cls.__qualname__}")
    kind = SpecKind(name, spec_cls, plugin, conformance)
    _REGISTERED[name] = kind
    return kind
