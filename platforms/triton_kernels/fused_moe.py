"""Fused mixture-of-experts MLP (top-k routed SwiGLU experts) in Triton: expert-sorted grouped GEMMs."""
from __future__ import annotations

from typing import Any

from halserve.platforms.triton_kernels.common import FLOATS, TritonKernel


class TritonFusedMoe(TritonKernel):
    op = "fused_moe"
    dtypes = FLOATS
    description = ("Triton fused MoE: (token, slot) pairs sorted by expert and padded to the tile, a grouped GEMM "
                   "with SiLU-and-mul fused (gate and up in one program), a grouped GEMM scaled by the routing weight, "
                   "a sum over the k slots; fp32 accumulation")

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {"activation": "silu", "host_sync": False, "tiles_by": "rows per expert (T * top_k / E)"}

    @classmethod
    def _supports_problem(cls, **problem: Any) -> str | None:
        e, k = problem.get("num_experts"), problem.get("top_k")
        if e is not None and k is not None and not 1 <= k <= e:
            return f"top_k {k} must be between 1 and num_experts {e}"
        return None

    def __call__(self, hidden, w13, w2, topk_weights, topk_ids):
        from halserve.platforms.triton_kernels.jit.fused_moe import fused_moe

        return fused_moe(hidden, w13, w2, topk_weights, topk_ids)
