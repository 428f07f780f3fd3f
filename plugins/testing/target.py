"""Where a plugin's kernels and backends run during conformance: platform, device, interpreter.

Rules (in order) for one kernel or attention backend:

1. the platform under test is ``--platform`` if given, else one of the plugin's own
   platforms the class runs on, else a platform named in the class's ``platforms``,
   else ``cpu`` (for ``("*",)`` classes);
2. if that platform is available here, the class runs on its device;
3. else, if the class is built on Triton and ``TRITON_INTERPRET=1`` is set, it runs on
   CPU tensors in the Triton interpreter (bfloat16 cases are then declined: the
   interpreter mis-computes bf16 arithmetic);
4. else every case is declined: "platform X unavailable here (its probe's reason)".

``prepare_interpreter`` sets ``TRITON_INTERPRET=1`` when a targeted platform is
unavailable and there is no GPU; it must run before any ``@triton.jit`` module is
imported (discovery imports none: kernel classes import their jit code at first call).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from halserve.attention_backends.base import AttentionBackend
    from halserve.kernels.base import Kernel

INTERPRETER_BF16_REASON = (
    "bfloat16 skipped under the Triton interpreter (it mis-computes bf16 arithmetic); "
    "this case runs compiled on a GPU"
)

INTERPRETER_FNUZ_REASON = (
    "float8_e4m3fnuz skipped under the Triton interpreter (it cannot convert fp8e4b8 to an IR type); "
    "this case runs compiled on an MI300"
)


def interpreter_decline(dtypes: tuple[str, ...]) -> str | None:
    """Why a case with these dtypes cannot run in the Triton interpreter, or None."""
    if "bfloat16" in dtypes:
        return INTERPRETER_BF16_REASON
    if "float8_e4m3fnuz" in dtypes:
        return INTERPRETER_FNUZ_REASON
    return None


@dataclass(frozen=True, slots=True)
class Target:
    platform: str  # the platform under test for this class
    device: str | None  # torch device string; None when nothing can run here
    interpreter: bool  # running Triton code on the CPU under TRITON_INTERPRET=1
    reason: str  # why declined (device None), else a short description

    @property
    def runnable(self) -> bool:
        return self.device is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def uses_triton(cls: type) -> bool:
    """True for classes built on Triton (a base class lives in a module named ``*triton*``)."""
    return any("triton" in (getattr(c, "__module__", "") or "") for c in cls.__mro__)


def _has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


class TargetResolver:
    """Decides targets for the classes of one plugin; caches probes and platform instances."""

    def __init__(self, manager: Any, plugin: str, platform: str | None = None):
        self.manager = manager
        self.plugin = plugin
        self.explicit = platform
        self.own_platforms = [r.name for r in manager.platforms.by_plugin(plugin)]
        self._probes: dict[str, Any] = {}
        self._instances: dict[str, Any] = {}

    def probe(self, name: str) -> tuple[bool, str]:
        if name not in self._probes:
            reg = self.manager.platforms.get(name)
            if reg is None:
                self._probes[name] = (False, f"no platform named {name!r} is registered")
            else:
                result = reg.obj.probe()
                self._probes[name] = (result.available, result.reason)
        return self._probes[name]

    def instance(self, name: str) -> Any:
        if name not in self._instances:
            self._instances[name] = self.manager.platforms[name].obj()
        return self._instances[name]

    def platform_for(self, cls: type[Kernel] | type[AttentionBackend]) -> str | None:
        """The platform ``cls`` is tested on, or None if it cannot run on the explicit one."""
        runs_on = cls.runs_on
        if self.explicit:
            return self.explicit if runs_on(self.explicit) else None
        candidates = [p for p in self.own_platforms if runs_on(p)]
        candidates += [p for p in getattr(cls, "platforms", ()) if p != "*" and p not in candidates]
        if not candidates:
            candidates = ["cpu"]
        for name in candidates:
            if self.probe(name)[0]:
                return name
        return candidates[0]

    def target(self, cls: type[Kernel] | type[AttentionBackend]) -> Target:
        platform = self.platform_for(cls)
        if platform is None:
            return Target(self.explicit or "-", None, False,
                          f"does not run on platform {self.explicit!r} (it runs on {', '.join(cls.platforms)})")
        available, reason = self.probe(platform)
        if available:
            try:
                device = str(self.instance(platform).device())
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                return Target(platform, None, False, f"platform {platform!r} failed to start: {type(exc).__name__}: {exc}")
            return Target(platform, device, False, f"on {platform} ({device})")
        if uses_triton(cls) and interpreting():
            return Target(platform, "cpu", True, f"platform {platform} unavailable here; Triton interpreter on the CPU")
        hint = ""
        if uses_triton(cls):
            hint = "; set TRITON_INTERPRET=1 to run its Triton code on the CPU"
        return Target(platform, None, False, f"platform {platform} unavailable here ({reason}){hint}")


def targeted_platforms(manager: Any, plugin: str, platform: str | None) -> list[str]:
    """Every platform the plugin's platforms, kernels and backends would be tested on."""
    if platform:
        return [platform]
    names = [r.name for r in manager.platforms.by_plugin(plugin)]
    for kind in ("kernels", "attention_backends"):
        for reg in manager.registries[kind].by_plugin(plugin):
            names += [p for p in getattr(reg.obj, "platforms", ()) if p != "*"]
    return list(dict.fromkeys(names)) or ["cpu"]


def prepare_interpreter(manager: Any, plugin: str, platform: str | None = None) -> bool:
    """Set ``TRITON_INTERPRET=1`` when a targeted platform is unavailable and no GPU exists.

    Returns whether the interpreter is on. Raises RuntimeError if Triton kernel modules
    were already imported in compiled mode (the setting would come too late).
    """
    if interpreting():
        return True
    resolver = TargetResolver(manager, plugin, platform)
    unavailable = [p for p in targeted_platforms(manager, plugin, platform) if not resolver.probe(p)[0]]
    if not unavailable or _has_gpu():
        return False
    jitted = sorted(m for m in sys.modules if m.startswith("halserve.") and (".jit." in m or m.endswith("_kernels")))
    jitted = [m for m in jitted if "triton" in m and m != "halserve.platforms.triton_kernels"]
    if jitted:
        raise RuntimeError(
            f"platforms {', '.join(unavailable)} are unavailable here, so their Triton kernels would run in the "
            f"interpreter, but {', '.join(jitted)} were already imported without TRITON_INTERPRET=1; "
            "set TRITON_INTERPRET=1 in the environment before starting Python"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    return True
