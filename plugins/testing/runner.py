"""Run every conformance check for one plugin and collect the capability matrix."""
from __future__ import annotations

from typing import Any

from halserve.plugins.testing.results import ConformanceReport

# plugin API 2: layers (overrides), communicator (Platform.make_device_communicator), variants (model variants)
CHECKS = ("platforms", "kernels", "attention", "e2e", "layers", "communicator", "variants")


class ConformanceSetupError(ValueError):
    """The plugin cannot be checked at all (unknown name, unknown platform)."""


def run_conformance(plugin: str, *, platform: str | None = None, quick: bool = False,
                    checks: tuple[str, ...] = CHECKS, manager: Any = None) -> ConformanceReport:
    """Check everything plugin ``plugin`` (its entry-point name) registers.

    ``platform`` tests kernels and backends on that platform instead of the plugin's own.
    Call ``prepare_interpreter`` first (the CLI and the pytest plugin do) when Triton
    kernels may have to run on the CPU. A plugin that failed to load yields one failed row.
    """
    from halserve.plugins import get_plugin_manager
    from halserve.plugins.testing import attention, communicator, e2e, kernels, layers, platform_checks, variants
    from halserve.plugins.testing.target import TargetResolver, interpreting

    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise ConformanceSetupError(f"unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    manager = manager or get_plugin_manager()
    record = manager.record(plugin)
    if record is None:
        raise ConformanceSetupError(
            f"no plugin named {plugin!r} is installed; installed plugins (entry points in group "
            f"'halserve.plugins'): {', '.join(r.name for r in manager.records) or 'none'}"
        )
    if platform is not None and platform not in manager.platforms:
        raise ConformanceSetupError(
            f"unknown platform {platform!r}; registered platforms: {', '.join(manager.platforms.names())}"
        )
    own = [r.name for r in manager.platforms.by_plugin(plugin)]
    report = ConformanceReport(plugin, platform or (own[0] if own else None), interpreting())
    if record.status != "loaded":
        report.add("plugin", plugin, "load", "failed",
                   f"plugin {plugin!r} is {record.status}: {record.error or 'disabled by HALSERVE_PLUGINS/HALSERVE_DISABLE_PLUGINS'}")
        return report
    manifest = record.manifest
    report.add("plugin", plugin, "load", "passed",
               f"{record.distribution or '?'} {manifest.version}, plugin API {manifest.api}")
    for warning in record.warnings:  # e.g. built for an older plugin API (still loaded, deprecated)
        report.add("plugin", plugin, "deprecations", "warned", warning)
    for conflict in manager.conflicts:
        if f"plugin {plugin!r}" in conflict:
            report.add("plugin", plugin, "unique names", "failed", conflict)
    resolver = TargetResolver(manager, plugin, platform)
    if "platforms" in checks:
        platform_checks.check_platforms(report, manager)
        platform_checks.check_update_config_hook(report, manager, platform)
    if "kernels" in checks:
        kernels.check_kernels(report, manager, resolver, quick)
    if "attention" in checks:
        attention.check_attention(report, manager, resolver, quick)
    if "e2e" in checks:
        e2e.check_e2e(report, manager, resolver, quick)
    if "layers" in checks:
        layers.check_layer_overrides(report, manager, plugin)
    if "communicator" in checks:
        communicator.check_communicators(report, manager, resolver)
    if "variants" in checks:
        variants.check_model_variants(report, manager, resolver)
    if len(report.results) == 1:
        report.add("plugin", plugin, "contributions", "warned",
                   "the plugin registers no platform, kernel or attention backend: nothing to check")
    return report
