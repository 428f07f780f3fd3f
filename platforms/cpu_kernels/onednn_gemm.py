"""Dense GEMM through oneDNN with weights prepacked once at load.

torch's default CPU ``linear`` goes through MKL's sgemm, which on some CPUs (measured on
this project's AMD EPYC machines: 100-170 GFLOP/s on 2 cores) is far from what the
cores can do; oneDNN with the weight reordered once into its blocked layout ran the same
float32 shapes at 340-420 GFLOP/s, exact to float32 rounding. vLLM's CPU build gets its
GEMM speed the same way.

bfloat16 runs through the same two calls: oneDNN picks its AMX (or AVX512-BF16) kernels and
accumulates in float32. Against torch's own bf16 ``F.linear`` (also oneDNN, but reordering
the weight on every call) the prepacked weight measured 1.5-1.8x faster at 64 rows (W1's
decode batch: 768 -> 2304/768/4096 and 2048 -> 768, 2 cores with AMX), 1.2-1.3x at 256 and
even at 2048 rows, with bit-identical results.
"""
from __future__ import annotations

import torch

from halserve.kernels.base import Kernel


class OneDnnGemm(Kernel):
    op = "gemm"
    name = "onednn"
    platforms = ("cpu",)
    priority = 10
    dtypes = ("float32", "bfloat16")
    description = "oneDNN matmul with the weight prepacked once at load (torch.ops.mkldnn)"

    @classmethod
    def _supports(cls, **problem) -> str | None:
        if not torch.backends.mkldnn.is_available():
            return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
        if problem.get("dtype") == "bfloat16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return "oneDNN has no bfloat16 kernels for this CPU (no AVX512-BF16/AMX/AVX512 support)"
        return None

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
        # weight [N, K] float32 or bfloat16 -> an opaque oneDNN tensor in its blocked layout
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not weight.is_mkldnn:  # an unprepared weight still works (conformance, tests)
            weight = self.prepare_weight(weight)
        # x [M, K] -> [M, N]
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
