"""Platforms: the Platform interface and selection of the one this process runs on."""
from __future__ import annotations

import os

from halserve.platforms.base import Platform, ProbeResult

__all__ = ["Platform", "PlatformUnavailableError", "ProbeResult", "list_platforms", "resolve_platform"]


class PlatformUnavailableError(RuntimeError):
    """An explicitly requested platform cannot run here (or no platform can)."""


def list_platforms() -> list[dict]:
    """Every registered platform with its probe result, highest priority first."""
    from halserve.plugins import get_plugin_manager

    manager = get_plugin_manager()
    rows = []
    for reg in manager.platforms:
        result = reg.obj.probe()
        rows.append(
            {
                "name": reg.name,
                "plugin": reg.plugin,
                "available": result.available,
                "reason": result.reason,
                "priority": reg.obj.priority,
                "device_type": reg.obj.device_type,
            }
        )
    rows.sort(key=lambda r: -r["priority"])
    return rows


def _table(rows: list[dict]) -> str:
    return "\n".join(
        f"  {r['name']}: {'available' if r['available'] else 'unavailable'} ({r['reason']})" for r in rows
    )


def resolve_platform(name: str | None = None) -> Platform:
    """Select the platform: ``name``, else ``HALSERVE_PLATFORM``, else auto-detection.

    An explicit platform that is unavailable (or unknown, or whose plugin failed) is an
    error that lists every known platform with its probe's reason.
    """
    from halserve.plugins import get_plugin_manager

    manager = get_plugin_manager()
    manager.check_conflicts()
    explicit = name or os.environ.get("HALSERVE_PLATFORM") or None
    if explicit:
        reg = manager.platforms.get(explicit)
        if reg is None:
            failed = [
                r for r in manager.records if r.status in ("failed", "refused") and r.name == explicit
            ]
            detail = ""
            if failed:
                detail = f"; plugin {explicit!r} did not load: {failed[0].error}"
            elif manager.record(explicit) is not None and manager.record(explicit).status == "disabled":
                detail = f"; plugin {explicit!r} is disabled by HALSERVE_PLUGINS/HALSERVE_DISABLE_PLUGINS"
            else:
                # The platform may come from a plugin named differently that did not load.
                broken = [r for r in manager.records if r.status in ("failed", "refused")]
                if broken:
                    detail = "; these plugins did not load and may provide it: " + "; ".join(
                        f"{r.name} ({r.status}: {r.error})" for r in broken
                    )
            raise PlatformUnavailableError(
                f"unknown platform {explicit!r}{detail}. Known platforms:\n{_table(list_platforms())}"
            )
        result = reg.obj.probe()
        if not result.available:
            raise PlatformUnavailableError(
                f"platform {explicit!r} is not available here: {result.reason}.\n"
                f"Known platforms:\n{_table(list_platforms())}"
            )
        return reg.obj()
    rows = list_platforms()
    for row in rows:
        if row["available"]:
            return manager.platforms[row["name"]].obj()
    raise PlatformUnavailableError(f"no platform is available here:\n{_table(rows)}")
