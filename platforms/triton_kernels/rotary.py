"""Rotary position embedding in Triton: neox and gpt-j styles, partial rotary_dim."""
from __future__ import annotations

from typing import Any

from halserve.platforms.triton_kernels.common import FLOATS, TritonKernel


class TritonRotaryEmbedding(TritonKernel):
    op = "rotary_embedding"
    dtypes = FLOATS
    description = "Triton rotary embedding, one program per token for all q and k heads; neox and gpt-j"

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {"styles": ["neox", "gptj"], "partial_rotary_dim": True}

    @classmethod
    def _supports_problem(cls, **problem: Any) -> str | None:
        d, r = problem.get("head_size"), problem.get("rotary_dim")
        if d is not None and r is not None and (r > d or r % 2):
            return f"rotary_dim {r} must be even and <= head_size {d}"
        return None

    def __call__(self, positions, q, k, cos_sin_cache, head_size, is_neox):
        from halserve.platforms.triton_kernels.jit.rotary import rotary_embedding

        return rotary_embedding(positions, q, k, cos_sin_cache, head_size, is_neox)
