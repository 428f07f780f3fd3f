"""RMSNorm (with the fused pre-norm residual add) in Triton."""
from __future__ import annotations

from typing import Any

from halserve.platforms.triton_kernels.common import FLOATS, TritonKernel

MAX_HIDDEN = 65536  # one row per program, held in registers


class TritonRmsNorm(TritonKernel):
    op = "rms_norm"
    dtypes = FLOATS
    description = "Triton RMSNorm, one program per row, optional fused residual add (returns out, x + residual)"

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {"fused_residual_add": True, "max_hidden_size": MAX_HIDDEN}

    @classmethod
    def _supports_problem(cls, **problem: Any) -> str | None:
        h = problem.get("hidden_size")
        if h is not None and h > MAX_HIDDEN:
            return f"hidden size {h} > {MAX_HIDDEN} (one row per program)"
        return None

    def __call__(self, x, weight, eps, residual=None):
        from halserve.platforms.triton_kernels.jit.rms_norm import rms_norm

        return rms_norm(x, weight, eps, residual)
