"""The ``gemm`` op for the example device: a K-blocked matmul with fp32 accumulation."""
from __future__ import annotations

from typing import Any

from halserve.kernels import Kernel

BLOCK_K = 32


class ExampleGemm(Kernel):
    op = "gemm"  # gemm(x[M,K], weight[N,K], bias[N] | None) -> [M,N]
    name = "example_gemm"
    platforms = ("example",)
    priority = 50  # above the torch reference (0)
    dtypes = ("float32", "float16", "bfloat16")
    description = "K-blocked matmul, fp32 accumulation, rounded once to the activation dtype"

    @classmethod
    def _supports(cls, **problem: Any) -> str | None:
        k = problem.get("k")
        if k is not None and k < 1:
            return f"K={k} must be positive"
        return None

    def __call__(self, x, weight, bias=None):
        import torch

        m, k = x.shape
        acc = torch.zeros(m, weight.shape[0], dtype=torch.float32, device=x.device)  # [M, N]
        for k0 in range(0, k, BLOCK_K):
            acc += x[:, k0 : k0 + BLOCK_K].float() @ weight[:, k0 : k0 + BLOCK_K].float().T
        if bias is not None:
            acc += bias.float()
        return acc.to(x.dtype)
