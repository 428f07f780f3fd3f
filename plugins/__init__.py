"""halserve's plugin contract: hooks, manifests, discovery and registries.

A plugin is a module named by an entry point in the ``halserve.plugins`` group::

    [project.entry-points."halserve.plugins"]
    myvendor = "halserve_myvendor.plugin"

and implements ``halserve_manifest`` plus any of the hooks in ``hookspecs``.
"""
from halserve.plugins.hookspecs import hookimpl
from halserve.plugins.load_formats import LoadFormat, LoadFormatError
from halserve.plugins.manager import (
    API_VERSION,
    ENTRY_POINT_GROUP,
    PluginManager,
    PluginRecord,
    PluginSelectionError,
    get_plugin_manager,
    reset_plugin_manager,
)
from halserve.plugins.manifest import PluginManifest
from halserve.plugins.overrides import LayerOverride, LayerOverrideError, ModelArchitecture
from halserve.plugins.registry import PluginConflictError, Registration, Registry

__all__ = [
    "API_VERSION",
    "ENTRY_POINT_GROUP",
    "LayerOverride",
    "LayerOverrideError",
    "LoadFormat",
    "LoadFormatError",
    "ModelArchitecture",
    "PluginConflictError",
    "PluginManager",
    "PluginManifest",
    "PluginRecord",
    "PluginSelectionError",
    "Registration",
    "Registry",
    "get_plugin_manager",
    "hookimpl",
    "reset_plugin_manager",
]
