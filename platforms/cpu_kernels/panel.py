"""What the cpu platform's native panel-GEMM kernels share (``native_int4.py``, ``native_fp8.py``; C++ in
``panel_gemm.h``): the check that this CPU can run them, and the build of the extension that registers
their ``torch.ops.halserve_cpu`` ops (a library per weight format: ``library``)."""
from __future__ import annotations

import functools
import os

import torch

from halserve.kernels.base import Kernel


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


class PanelKernel(Kernel):
    """A kernel on the native panel GEMM: AMX where the CPU and the OS allow it (``isa == "amx"``),
    AVX512-BF16 dot products otherwise; declined on CPUs without AVX512-BF16."""

    name = "cpu_native"
    platforms = ("cpu",)
    library = ""  # the native library (cpu_kernels.LIBRARIES) holding this kernel's op: "int4", "fp8"

    @classmethod
    def _supports(cls, **problem) -> str | None:
        from halserve.platforms.cpu_kernels import build, toolchain_missing

        if "avx512_bf16" not in cpu_flags():
            return f"{cls.op}/cpu_native needs AVX512-BF16 (this CPU's /proc/cpuinfo flags lack avx512_bf16)"
        if not build.target_has("__AVX512BF16__"):
            return (f"{cls.op}/cpu_native needs AVX512-BF16, which the kernels' build target "
                    f"({build.MARCH_ENV}={os.environ.get(build.MARCH_ENV)}) lacks")
        return toolchain_missing()

    def __init__(self) -> None:
        from halserve.platforms import cpu_kernels

        if cpu_kernels.load_library(self.library) is None:  # builds it once; it registers the ops
            raise RuntimeError(f"{self.op}/cpu_native: {cpu_kernels.load_error(self.library)}")
        # "amx" | "avx512_bf16" (tests may force the latter); each library names its copy of the query
        self.isa = getattr(torch.ops.halserve_cpu, f"{self.library}_panel_gemm_isa")()
        if not self.isa:
            raise RuntimeError(f"halserve's native CPU kernels were built without AVX512-BF16 (-march=native on a "
                               f"CPU without it): {self.op}/cpu_native cannot run here")
