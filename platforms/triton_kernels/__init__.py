"""Triton kernels for the GEMM-family and elementwise ops, shared by the cuda and rocm plugins.

Each module holds the ``halserve.kernels.Kernel`` classes of one op family; the
``@triton.jit`` device code lives in ``jit/`` and is imported at first call, so
``halserve plugins`` lists these kernels without importing triton. ``kernels_for(platform)``
returns the per-platform subclasses a platform plugin registers (names ``triton_cuda`` /
``triton_rocm``: kernel names are unique per op across all plugins).
"""
from halserve.platforms.triton_kernels.common import TritonKernel, kernels_for

__all__ = ["TritonKernel", "kernels_for"]
