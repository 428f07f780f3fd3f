"""Fused elementwise kernels of the cpu platform (C++ in ``elementwise.cpp``, float32 and
bfloat16): one pass over memory for the residual-add + RMSNorm, the rotary embedding and
SiLU-and-mul, where the torch references take several ops and temporaries (in bf16 each of
them also widens and narrows its operands: ~30% of a W1 bf16 run before these kernels took
bf16). bf16 computes in float32 and rounds where the references do. Other cases (no residual,
mixed dtypes) go through torch's own fused ``rms_norm`` or the reference. ``scaled_int8_quant``
(W8A8's activation quant) reads each row twice (amax, then int8) and equals the reference
exactly."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from halserve.kernels.base import Kernel
from halserve.kernels.reference import TorchRmsNorm, TorchRotaryEmbedding


def _module():
    from halserve.platforms import cpu_kernels

    module = cpu_kernels.load()
    if module is None:
        raise RuntimeError(f"the cpu platform's native kernels could not be built: {cpu_kernels.load_error('core')}")
    return module


class _NativeKernel(Kernel):
    platforms = ("cpu",)
    priority = 10
    dtypes = ("float32", "bfloat16")

    @classmethod
    def _supports(cls, **problem) -> str | None:
        from halserve.platforms.cpu_kernels import toolchain_missing

        return toolchain_missing()

    def __init__(self) -> None:
        self.native = _module()


class CpuFusedRmsNorm(_NativeKernel):
    op = "rms_norm"
    name = "cpu_fused"
    description = "residual add + RMSNorm in one C++ pass; torch.rms_norm without a residual"

    def __init__(self) -> None:
        super().__init__()
        self.fallback = TorchRmsNorm()

    def __call__(self, x, weight, eps, residual=None):
        if x.dtype != torch.float32 and (residual is None or weight.dtype != x.dtype or x.dim() != 2):
            return self.fallback(x, weight, eps, residual)  # the reference's bf16 rounding steps
        if residual is None:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        out, summed = self.native.add_rms_norm(x, residual, weight, eps)
        return out, summed


class CpuFusedRotaryEmbedding(_NativeKernel):
    op = "rotary_embedding"
    name = "cpu_fused"
    description = "q and k rotated in one C++ pass from the cos/sin cache"

    def __init__(self) -> None:
        super().__init__()
        self.fallback = TorchRotaryEmbedding()

    def __call__(self, positions, q, k, cos_sin_cache, head_size, is_neox):
        native = q.dtype in (torch.float32, torch.bfloat16) and k.dtype == q.dtype and q.dim() == 2
        if not native or q.stride(-1) != 1 or k.stride(-1) != 1:
            return self.fallback(positions, q, k, cos_sin_cache, head_size, is_neox)
        return tuple(self.native.rotary(positions, q, k, cos_sin_cache.float(), head_size, is_neox))


class CpuFusedSiluAndMul(_NativeKernel):
    op = "silu_and_mul"
    name = "cpu_fused"
    description = "silu(gate) * up in one C++ pass with a 16-lane exp (float32, bfloat16)"

    def __call__(self, x):
        return self.native.silu_and_mul(x)


class CpuScaledInt8Quant(_NativeKernel):
    op = "scaled_int8_quant"
    name = "cpu_fused"
    description = "per-token (or static) int8 quant in C++: one pass for the amax, one writing int8"

    def __init__(self) -> None:
        super().__init__()
        # a TORCH_LIBRARY op of the core library, registered when _module() loaded it
        self.quant = torch.ops.halserve_cpu.scaled_int8_quant

    def __call__(self, x, scale=None):
        return tuple(self.quant(x, scale))
