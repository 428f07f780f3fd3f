"""Gated MLP activations in Triton: SiLU-and-mul (Llama's SwiGLU) and GELU(tanh)-and-mul (Gemma)."""
from __future__ import annotations

from halserve.platforms.triton_kernels.common import FLOATS, TritonKernel


class TritonSiluAndMul(TritonKernel):
    op = "silu_and_mul"
    dtypes = FLOATS
    description = "Triton silu(gate) * up in fp32, rounded once to the activation dtype"

    def __call__(self, x):
        from halserve.platforms.triton_kernels.jit.activation import silu_and_mul

        return silu_and_mul(x)


class TritonGeluTanhAndMul(TritonKernel):
    op = "gelu_tanh_and_mul"
    dtypes = FLOATS
    description = "Triton gelu_tanh(gate) * up in fp32 (tanh as a sigmoid), rounded once to the activation dtype"

    def __call__(self, x):
        from halserve.platforms.triton_kernels.jit.activation import gelu_tanh_and_mul

        return gelu_tanh_and_mul(x)
