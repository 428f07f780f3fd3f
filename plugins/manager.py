"""Discovery: load every ``halserve.plugins`` entry point once per process.

    entry points --(HALSERVE_PLUGINS / HALSERVE_DISABLE_PLUGINS)--> import module
        --> halserve_manifest() --(api range check)--> check every hook (hookimpls.py)
        --> pluggy register --> call each contribution hook of this plugin
        --> registries (one per kind; names unique per kind)

A plugin that fails to import, has a hook halserve does not know or with arguments its
spec does not have, raises in a hook, or is incompatible is recorded with its error and
a warning is logged; its contributions are dropped as a whole (and it is unregistered
from pluggy), so a broken plugin never half-registers. Everything else keeps working.
"""
from __future__ import annotations

import logging
import os
import threading
import traceback
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any, Literal

from halserve.plugins.hookimpls import FoundHook, HookManager, check_hookimpls, find_hookimpls
from halserve.plugins.load_formats import check_load_format
from halserve.plugins.manifest import PluginManifest
from halserve.plugins.overrides import check_layer_override, check_model_variant
from halserve.plugins.registry import PluginConflictError, Registry

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig

logger = logging.getLogger(__name__)

API_VERSION = 2
# The oldest plugin API still loaded (deprecation policy, docs/plugins.md): a plugin whose manifest
# range holds no version from here to API_VERSION is refused. API 2 only added hooks and members
# (layer overrides, platform-scoped model variants, load formats, Platform.make_device_communicator), so an API 1 plugin runs unchanged, with a
# DeprecationWarning asking its author to test under API 2 and widen its range.
OLDEST_SUPPORTED_API = 1
ENTRY_POINT_GROUP = "halserve.plugins"

PluginStatus = Literal["loaded", "failed", "refused", "disabled"]

# hook name -> registry kind
CONTRIBUTION_HOOKS = {
    "halserve_platforms": "platforms",
    "halserve_attention_backends": "attention_backends",
    "halserve_kernels": "kernels",
    "halserve_quant_methods": "quant_methods",
    "halserve_kv_connectors": "kv_connectors",
    "halserve_executors": "executors",
    "halserve_model_architectures": "models",
    "halserve_layer_overrides": "layer_overrides",  # (plugin API 2)
    "halserve_load_formats": "load_formats",  # (plugin API 2)
}
# kinds the hooks above fill besides their own: platform-scoped architectures (plugin API 2)
EXTRA_KINDS = {"model_variants": "model variant", "layer_overrides": "layer override"}


# Deprecated hooks: name -> (plugin API version that deprecated it, what to implement instead).
# A deprecated hook keeps working for at least one full API version (docs/plugins.md);
# a plugin implementing one gets a DeprecationWarning, recorded on its PluginRecord and
# shown by `halserve plugins`. Plugin API 1 deprecates nothing yet.
DEPRECATED_HOOKS: dict[str, tuple[int, str]] = {}


class PluginSelectionError(ValueError):
    """HALSERVE_PLUGINS / HALSERVE_DISABLE_PLUGINS names a plugin that does not exist."""


@dataclass(slots=True)
class PluginRecord:
    name: str  # entry-point name
    target: str  # "module" or "module:attr"
    distribution: str | None  # the wheel that declared the entry point
    status: PluginStatus = "disabled"
    manifest: PluginManifest | None = None
    error: str | None = None  # one-line reason, for listings
    traceback: str | None = None  # summary of the failure, for `halserve plugins`
    warnings: list[str] = field(default_factory=list)  # deprecations and other warnings at load

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.manifest.version if self.manifest else None,
            "distribution": self.distribution,
            "api": self.manifest.api if self.manifest else None,
            "description": self.manifest.description if self.manifest else None,
            "target": self.target,
            "status": self.status,
            "error": self.error,
            "warnings": list(self.warnings),
        }


@dataclass
class PluginManager:
    """The loaded plugins of this process and one registry per kind."""

    records: list[PluginRecord] = field(default_factory=list)
    registries: dict[str, Registry] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)
    pm: HookManager = field(default_factory=HookManager)  # loaded plugins only

    def __post_init__(self) -> None:
        for kind in CONTRIBUTION_HOOKS.values():
            self.registries.setdefault(kind, Registry(EXTRA_KINDS.get(kind, kind.rstrip("s"))))
        for kind, label in EXTRA_KINDS.items():
            self.registries.setdefault(kind, Registry(label))

    # -- accessors ---------------------------------------------------------------
    @property
    def platforms(self) -> Registry:
        return self.registries["platforms"]

    @property
    def attention_backends(self) -> Registry:
        return self.registries["attention_backends"]

    @property
    def kernels(self) -> Registry:
        return self.registries["kernels"]

    @property
    def quant_methods(self) -> Registry:
        return self.registries["quant_methods"]

    @property
    def kv_connectors(self) -> Registry:
        return self.registries["kv_connectors"]

    @property
    def executors(self) -> Registry:
        return self.registries["executors"]

    @property
    def models(self) -> Registry:
        return self.registries["models"]

    @property
    def model_variants(self) -> Registry:
        """``"<platform>/<architecture>"`` -> a ``ModelArchitecture`` declaring ``override=True``."""
        return self.registries["model_variants"]

    @property
    def load_formats(self) -> Registry:
        """``--load-format`` name -> a ``LoadFormat`` subclass (plugins' formats; halserve's own are not here)."""
        return self.registries["load_formats"]

    @property
    def layer_overrides(self) -> Registry:
        """``"<platform>/<built-in class>"`` -> a checked ``LayerOverride``."""
        return self.registries["layer_overrides"]

    def record(self, name: str) -> PluginRecord | None:
        return next((r for r in self.records if r.name == name), None)

    def check_conflicts(self) -> None:
        """Raise if two plugins claimed one name (discovery records, this enforces)."""
        if self.conflicts:
            raise PluginConflictError("; ".join(self.conflicts))

    # -- loading -----------------------------------------------------------------
    def load_plugin(self, name: str, plugin: Any, record: PluginRecord) -> None:
        """Register one imported plugin: manifest and API check, then every hook checked,
        then its contributions collected. Any failure drops the plugin whole."""
        try:
            found = find_hookimpls(self.pm, name, plugin)
            manifest = self._read_manifest(name, plugin, found)
        except Exception as exc:
            _fail(record, exc)
            return
        record.manifest = manifest
        if not manifest.supports_api(API_VERSION):
            older = [v for v in range(API_VERSION - 1, OLDEST_SUPPORTED_API - 1, -1) if manifest.supports_api(v)]
            if not older:
                record.status = "refused"
                record.error = (
                    f"plugin {name!r} {manifest.version} supports halserve plugin API {manifest.api}, "
                    f"but this halserve provides plugin API {API_VERSION} (and still loads plugins for API "
                    f"{OLDEST_SUPPORTED_API} to {API_VERSION}); install a version of the plugin built for this API"
                )
                logger.warning("halserve plugin refused: %s", record.error)
                return
            warnings.warn(
                f"plugin {name!r} {manifest.version} declares plugin API {manifest.api}, built for API {older[0]}; "
                f"this halserve provides API {API_VERSION} and loads API {older[0]} plugins unchanged (deprecated "
                f"since API {API_VERSION}, removed at the earliest in API {API_VERSION + 1}); test it under API "
                f"{API_VERSION} and declare api='>={OLDEST_SUPPORTED_API},<{API_VERSION + 1}'",
                DeprecationWarning,
                stacklevel=2,
            )
        for item in found:
            if item.hook in DEPRECATED_HOOKS:
                since, replacement = DEPRECATED_HOOKS[item.hook]
                warnings.warn(
                    f"plugin {name!r} implements {item.hook}, deprecated since plugin API {since}; {replacement}",
                    DeprecationWarning,
                    stacklevel=2,
                )
        contributions: list[tuple[str, str, Any]] = []
        try:
            check_hookimpls(self.pm, name, plugin, found)
            self.pm.register(plugin, name=name)  # pluggy validates the signatures again
            for hook, kind in CONTRIBUTION_HOOKS.items():
                for result in self.call_plugin_hook(name, hook):
                    contributions.extend(_items(kind, result, name))
        except Exception as exc:
            if self.pm.has_plugin(name) and self.pm.get_plugin(name) is plugin:
                self.pm.unregister(name=name)
            _fail(record, exc)
            return
        for kind, item_name, obj in contributions:
            try:
                self.registries[kind].add(item_name, name, obj)
            except PluginConflictError as exc:
                if kind == "models":  # (plugin API 2) the declared way to replace a built-in
                    exc = PluginConflictError(
                        f"{exc}; to replace the built-in {item_name} on your platform only, return "
                        f"{{{item_name!r}: ModelArchitecture('module:Class', platform=<your platform>, "
                        "override=True)}} from halserve_model_architectures"
                    )
                self.conflicts.append(str(exc))
                logger.warning("halserve plugin conflict: %s", exc)
        record.status = "loaded"

    def _read_manifest(self, name: str, plugin: Any, found: list[FoundHook]) -> PluginManifest:
        # Read before the other hooks are checked, so that a plugin built for another API
        # (which may have hooks this halserve does not know) is refused, not failed.
        mine = [item for item in found if item.hook == "halserve_manifest"]
        if not mine:
            raise TypeError(
                f"plugin {name!r} does not implement halserve_manifest(); every plugin "
                "must return a halserve.plugins.PluginManifest"
            )
        check_hookimpls(self.pm, name, plugin, mine)
        manifest = mine[0].impl.function()
        if manifest is None:
            raise TypeError(f"halserve_manifest() of plugin {name!r} returned None, not a PluginManifest")
        if not isinstance(manifest, PluginManifest):
            manifest = PluginManifest.model_validate(manifest)
        return manifest

    def call_plugin_hook(self, plugin: str, hook: str, **kwargs: Any) -> list[Any]:
        """Call one registered plugin's implementation of ``hook`` with keyword arguments
        (each implementation gets the ones it declares); its non-``None`` results, ``[]``
        if it does not implement the hook."""
        results = []
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            if impl.plugin_name == plugin:
                result = impl.function(**{arg: kwargs[arg] for arg in impl.argnames})
                if result is not None:
                    results.append(result)
        return results

    def implements(self, plugin: str, hook: str) -> bool:
        """Whether the registered plugin ``plugin`` implements ``hook``."""
        caller = getattr(self.pm.hook, hook, None)
        return caller is not None and any(impl.plugin_name == plugin for impl in caller.get_hookimpls())

    def call_update_config(self, config: EngineConfig, platform: str) -> None:
        """Every loaded plugin's ``halserve_update_config``, in pluggy's order."""
        self.pm.hook.halserve_update_config(config=config, platform=platform)


def _items(kind: str, result: Any, plugin: str) -> Iterable[tuple[str, str, Any]]:
    """(registry kind, name, object) of each thing one hook call contributed, checked."""
    if result is None:
        return []
    if kind == "models":
        if not isinstance(result, dict):
            raise TypeError(f"halserve_model_architectures must return a dict, got {type(result).__name__}")
        from halserve.models.interfaces import check_architecture

        models: list[tuple[str, str, Any]] = []
        for arch, target in result.items():
            variant = check_model_variant(plugin, arch, target)
            check_architecture(arch, target if variant is None else variant.target)  # a class missing a member
            if variant is None:
                models.append(("models", arch, target))
            else:
                models.append(("model_variants", f"{variant.platform}/{arch}", variant))
        return models
    if not isinstance(result, (list, tuple)):
        raise TypeError(f"the {kind} hook of plugin {plugin!r} must return a list, got {type(result).__name__}")
    items = []
    for obj in result:
        if kind == "kernels":
            items.append((kind, f"{obj.op}/{obj.name}", obj))
        elif kind == "load_formats":
            items.append((kind, check_load_format(plugin, obj).name, obj))  # a reserved name fails the plugin
        elif kind == "layer_overrides":
            override = check_layer_override(plugin, obj)  # a contract mismatch: the plugin fails, naming it
            items.append((kind, override.key, override))
        else:
            items.append((kind, obj.name, obj))
    return items


def _fail(record: PluginRecord, exc: BaseException) -> None:
    record.status = "failed"
    record.error = f"{type(exc).__name__}: {exc}"
    tb = traceback.extract_tb(exc.__traceback__)
    record.traceback = "".join(traceback.format_list(tb[-4:])) + record.error
    logger.warning("halserve plugin %r failed to load: %s", record.name, record.error)


def _env_names(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return None
    return {n.strip() for n in raw.split(",") if n.strip()}


def discover() -> PluginManager:
    """Build a fresh manager from the installed entry points (no caching)."""
    manager = PluginManager()
    eps = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    known = {ep.name for ep in eps}
    allow = _env_names("HALSERVE_PLUGINS")
    block = _env_names("HALSERVE_DISABLE_PLUGINS")
    for var, names in (("HALSERVE_PLUGINS", allow), ("HALSERVE_DISABLE_PLUGINS", block)):
        unknown = sorted((names or set()) - known)
        if unknown:
            raise PluginSelectionError(
                f"{var} names unknown plugin(s) {', '.join(unknown)}; installed plugins are: "
                f"{', '.join(sorted(known))}"
            )
    seen: set[str] = set()
    for ep in sorted(eps, key=lambda e: e.name):
        if ep.name in seen:  # the same distribution found twice on sys.path
            continue
        seen.add(ep.name)
        dist = ep.dist.name if ep.dist is not None else None
        record = PluginRecord(name=ep.name, target=ep.value, distribution=dist)
        manager.records.append(record)
        if (allow is not None and ep.name not in allow) or (block is not None and ep.name in block):
            record.status = "disabled"
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                plugin = ep.load()
            except BaseException as exc:  # a plugin may even sys.exit() at import
                if isinstance(exc, KeyboardInterrupt):
                    raise
                _fail(record, exc)
                plugin = None
            if plugin is not None:
                manager.load_plugin(ep.name, plugin, record)
        for w in caught:
            record.warnings.append(f"{w.category.__name__}: {w.message}")
            logger.warning("halserve plugin %r: %s: %s", ep.name, w.category.__name__, w.message)
    return manager


_manager: PluginManager | None = None
_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide manager; discovery runs on first call (thread-safe, once)."""
    global _manager
    if _manager is None:
        with _lock:
            if _manager is None:
                _manager = discover()
    return _manager


def reset_plugin_manager() -> None:
    """Forget the cached discovery (tests, or after installing a plugin at run time)."""
    global _manager
    with _lock:
        _manager = None
