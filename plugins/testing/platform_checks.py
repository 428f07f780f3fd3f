"""Platform and plugin-level conformance: declarations, probe, config hooks."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from halserve.plugins.testing.results import ConformanceReport, Status

if TYPE_CHECKING:  # pragma: no cover
    from halserve.platforms.base import Platform

ALLOWED_DTYPES = ("float32", "float16", "bfloat16")
ALLOWED_FP8 = (None, "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2")
# torch device type -> distributed backends known to work with it
DIST_BACKENDS = {
    "cpu": ("gloo",),
    "cuda": ("nccl",),  # CUDA (NCCL) and ROCm (RCCL behind the nccl name)
    "xpu": ("xccl", "ccl"),
    "xla": ("xla", "gloo"),
}
SLOW_PROBE_S = 1.0


def check_platforms(report: ConformanceReport, manager: Any) -> None:
    for reg in manager.platforms.by_plugin(report.plugin):
        cls = reg.obj
        add = lambda case, status, detail="", name=reg.name: report.add("platform", name, case, status, detail)  # noqa: E731
        start = time.perf_counter()
        try:
            result = cls.probe()
        except Exception as exc:  # noqa: BLE001
            add("probe", "failed", f"probe() raised {type(exc).__name__}: {exc}; it must return a ProbeResult")
            result = None
        took = time.perf_counter() - start
        if result is not None:
            if not getattr(result, "reason", ""):
                add("probe", "failed", f"probe() returned {result!r} without a reason; say why it is (un)available")
            elif result.reason.startswith("probe raised") or result.reason.startswith(f"probe of {cls.name!r}"):
                add("probe", "failed", f"_probe() misbehaved: {result.reason}")
            else:
                state = "available" if result.available else "unavailable"
                add("probe", "passed", f"{state}: {result.reason} ({took * 1000:.0f} ms)")
                if took > SLOW_PROBE_S:
                    add("probe speed", "warned", f"probe() took {took:.1f}s; it runs on every halserve start")
        for case, status, detail in declaration_problems(cls, manager):
            add(case, status, detail)
        _check_config_idempotent(report, reg.name, cls)


def declaration_problems(cls: type[Platform], manager: Any) -> list[tuple[str, str, str]]:
    out = []
    dtypes = tuple(getattr(cls, "supported_dtypes", ()) or ())
    bad = [d for d in dtypes if d not in ALLOWED_DTYPES]
    if not dtypes or bad:
        out.append(("dtypes", "failed", f"supported_dtypes {dtypes!r} must be a non-empty subset of {ALLOWED_DTYPES}"))
    elif cls.default_dtype not in dtypes:
        out.append(("dtypes", "failed", f"default_dtype {cls.default_dtype!r} is not in supported_dtypes {dtypes!r}"))
    else:
        out.append(("dtypes", "passed", f"{', '.join(dtypes)}; default {cls.default_dtype}"))
    device, dist = getattr(cls, "device_type", None), getattr(cls, "dist_backend", None)
    if not (isinstance(device, str) and device and isinstance(dist, str) and dist):
        out.append(("device/dist backend", "failed",
                    f"device_type {device!r} and dist_backend {dist!r} must be non-empty strings"))
    elif device not in DIST_BACKENDS:
        out.append(("device/dist backend", "warned",
                    f"device_type {device!r} is not one the kit knows ({', '.join(DIST_BACKENDS)}); "
                    f"cannot check dist_backend {dist!r}"))
    elif dist not in DIST_BACKENDS[device]:
        out.append(("device/dist backend", "failed",
                    f"dist_backend {dist!r} does not go with device_type {device!r} "
                    f"(expected {' or '.join(DIST_BACKENDS[device])})"))
    else:
        out.append(("device/dist backend", "passed", f"{device} + {dist}"))
    fp8 = getattr(cls, "fp8_dtype", None)
    if fp8 not in ALLOWED_FP8:
        out.append(("fp8 dtype", "failed", f"fp8_dtype {fp8!r} must be one of {ALLOWED_FP8}"))
    else:
        out.append(("fp8 dtype", "passed", str(fp8)))
    preferred = tuple(getattr(cls, "preferred_attention_backends", ()) or ())
    registry = manager.attention_backends
    if not preferred:
        out.append(("preferred backends", "failed", "preferred_attention_backends is empty; list at least 'torch'"))
    for name in preferred:
        reg = registry.get(name)
        if reg is None:
            out.append(("preferred backends", "failed",
                        f"preferred attention backend {name!r} is not registered by any loaded plugin "
                        f"(registered: {', '.join(registry.names())})"))
        elif not reg.obj.runs_on(cls.name):
            out.append(("preferred backends", "failed",
                        f"preferred attention backend {name!r} (plugin {reg.plugin}) does not run on platform "
                        f"{cls.name!r}: its platforms are {reg.obj.platforms}"))
    if preferred and all(registry.get(n) is not None and registry.get(n).obj.runs_on(cls.name) for n in preferred):
        out.append(("preferred backends", "passed", ", ".join(preferred)))
    return out


def _check_config_idempotent(report: ConformanceReport, name: str, cls: type[Platform]) -> None:
    from halserve.config import EngineConfig

    try:
        platform = cls()
    except Exception as exc:  # noqa: BLE001
        available = cls.probe()
        status: Status = "declined" if not available.available else "failed"
        report.add("platform", name, "check_and_update_config idempotent", status,
                   f"could not instantiate {cls.__name__}: {type(exc).__name__}: {exc}"
                   + ("" if available.available else f" (platform unavailable here: {available.reason})"))
        return
    for dtype in ("auto", cls.default_dtype):
        case = f"check_and_update_config idempotent (dtype={dtype})"
        config = EngineConfig(model="halserve-conformance/dummy", platform=name, dtype=dtype)
        try:
            once = config.model_copy(deep=True)
            platform.check_and_update_config(once)
            first = once.model_dump()
            platform.check_and_update_config(once)
            second = once.model_dump()
        except Exception as exc:  # noqa: BLE001
            report.add("platform", name, case, "failed", f"raised {type(exc).__name__}: {exc}")
            continue
        if first != second:
            report.add("platform", name, case, "failed", f"second call changed {_diff(first, second)}")
        else:
            report.add("platform", name, case, "passed", "same config after one and two calls")


def check_update_config_hook(report: ConformanceReport, manager: Any, platform: str | None) -> None:
    from halserve.config import EngineConfig

    if not manager.implements(report.plugin, "halserve_update_config"):
        report.add("plugin", report.plugin, "halserve_update_config idempotent", "declined",
                   "the plugin does not implement halserve_update_config")
        return
    names = [r.name for r in manager.platforms.by_plugin(report.plugin)] or [platform or "cpu"]
    for name in names:
        case = f"halserve_update_config idempotent (platform={name})"
        config = EngineConfig(model="halserve-conformance/dummy", platform=name)
        try:
            manager.call_plugin_hook(report.plugin, "halserve_update_config", config=config, platform=name)
            first = config.model_dump()
            manager.call_plugin_hook(report.plugin, "halserve_update_config", config=config, platform=name)
            second = config.model_dump()
        except Exception as exc:  # noqa: BLE001
            report.add("plugin", report.plugin, case, "failed", f"raised {type(exc).__name__}: {exc}")
            continue
        status: Status = "passed" if first == second else "failed"
        detail = "same config after one and two calls" if first == second else f"second call changed {_diff(first, second)}"
        report.add("plugin", report.plugin, case, status, detail)


def _diff(a: dict, b: dict) -> str:
    return ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
