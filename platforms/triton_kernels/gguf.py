"""GGUF GEMM (``gguf_gemm``): Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K blocks as the file stores them, dequantized
in registers inside the K loop (``jit/gguf_gemm.py``). The activations stay float, so the result is the torch
reference's up to the dot's operand dtype.

Token embeddings in GGUF types need no kernel of their own: a lookup dequantizes only the rows it reads with
``halserve.kernels.gguf_blocks.dequantize`` (torch ops, on whatever device holds the blocks)."""
from __future__ import annotations

from typing import Any

from halserve.platforms.triton_kernels.common import FLOATS, TritonKernel


class TritonGgufGemm(TritonKernel):
    op = "gguf_gemm"
    dtypes = FLOATS
    description = "Triton GGUF GEMM: blocks dequantized in registers in the K loop, float activations"

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        from halserve.kernels.gguf_blocks import QUANTIZED_TYPES

        return {"qtypes": list(QUANTIZED_TYPES), "activations": "float (not rounded to 8 bits)", "bias": True}

    @classmethod
    def _supports_problem(cls, **problem: Any) -> str | None:
        from halserve.kernels.gguf_blocks import GGUF_BLOCKS

        qtype, k = problem.get("qtype"), problem.get("k")
        if qtype is None:
            return None
        if qtype not in GGUF_BLOCKS:
            return f"GGUF type {qtype} is not one of {', '.join(GGUF_BLOCKS)}"
        block = GGUF_BLOCKS[qtype][0]
        if k is not None and k % block:
            return f"K={k} is not a whole number of {qtype} blocks ({block} values)"
        return None

    def __call__(self, x, qweight, qtype, bias=None):
        from halserve.platforms.triton_kernels.jit.gguf_gemm import gguf_gemm

        return gguf_gemm(x, qweight, qtype, bias)
