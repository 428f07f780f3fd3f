"""Pick the kernel for an op on a platform: highest priority whose supports() accepts."""
from __future__ import annotations

import logging
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
    reasons = []
    for cls in kernel_candidates(op, platform):
        reason = cls.supports(**problem)
        if reason is None:
            logger.debug("op %s on %s resolves to %s for %s", op, platform, cls.name, problem)
            return cls()
        reasons.append(f"{cls.name}: {reason}")
    raise KernelNotFoundError(
        f"no kernel for op {op!r} on platform {platform!r} supports {problem}; "
        + ("; ".join(reasons) if reasons else "no kernel is registered for it")
    )
