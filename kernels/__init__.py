"""Kernels: named ops, their torch references, and resolution per platform."""
from halserve.kernels.base import ANY_PLATFORM, Kernel
from halserve.kernels.ops import OPS, OpSpec
from halserve.kernels.resolve import KernelNotFoundError, kernel_candidates, resolve_kernel

__all__ = [
    "ANY_PLATFORM",
    "Kernel",
    "KernelNotFoundError",
    "OPS",
    "OpSpec",
    "kernel_candidates",
    "resolve_kernel",
]
