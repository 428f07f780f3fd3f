"""Pick the kernel for an op on a platform: highest priority whose supports() accepts.

``HALSERVE_KERNELS=op=name,op=name`` pins ops to kernels by name (``halserve plugins`` lists them),
e.g. ``gptq_gemm=torch`` to rule a vendor kernel out while debugging. A pinned kernel that does not
exist, does not run on the platform or declines the problem is an error, never a silent fallback.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from halserve.kernels.base import Kernel
from halserve.kernels.ops import OPS

logger = logging.getLogger(__name__)


class KernelNotFoundError(RuntimeError):
    pass


def kernel_candidates(op: str, platform: str) -> list[type[Kernel]]:
    """Kernels registered for ``op`` that run on ``platform``, best first."""
    from halserve.plugins import get_plugin_manager

    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops are: {', '.join(OPS)}")
    regs = [r.obj for r in get_plugin_manager().kernels if r.obj.op == op and r.obj.runs_on(platform)]
    return sorted(regs, key=lambda k: -k.priority)


def resolve_kernel(op: str, platform: str, **problem: Any) -> Kernel:
    """Instantiate the best kernel for ``op`` on ``platform`` that supports ``problem``.

    Called once per layer at model load. Raises ``KernelNotFoundError`` listing each
    candidate's reason when none supports the problem.
    """
    candidates = kernel_candidates(op, platform)
    pinned = kernel_pins().get(op)
    if pinned is not None:
        chosen = [cls for cls in candidates if cls.name == pinned]
        if not chosen:
            raise KernelNotFoundError(
                f"HALSERVE_KERNELS pins op {op!r} to kernel {pinned!r}, which is not registered for platform "
                f"{platform!r} (its kernels: {', '.join(c.name for c in candidates) or 'none'})")
        candidates = chosen
    reasons = []
    for cls in candidates:
        reason = cls.supports(**problem)
        if reason is None:
            logger.debug("op %s on %s resolves to %s for %s", op, platform, cls.name, problem)
            return cls()
        reasons.append(f"{cls.name}: {reason}")
    raise KernelNotFoundError(
        f"no kernel for op {op!r} on platform {platform!r}{' (pinned by HALSERVE_KERNELS)' if pinned else ''} "
        f"supports {problem}; "
        + ("; ".join(reasons) if reasons else "no kernel is registered for it")
    )


def kernel_pins() -> dict[str, str]:
    """``HALSERVE_KERNELS`` as ``{op: kernel name}``; a malformed entry or an unknown op is an error."""
    pins = {}
    for entry in filter(None, (e.strip() for e in os.environ.get("HALSERVE_KERNELS", "").split(","))):
        op, sep, name = (part.strip() for part in entry.partition("="))
        if not sep or not op or not name:
            raise ValueError(f"HALSERVE_KERNELS entry {entry!r} must be op=kernel (e.g. gptq_gemm=torch)")
        if op not in OPS:
            raise ValueError(f"HALSERVE_KERNELS names unknown op {op!r}; ops are: {', '.join(OPS)}")
        pins[op] = name
    return pins
