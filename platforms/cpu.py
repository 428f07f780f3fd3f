"""The CPU platform: always available, the reference every other platform is checked against."""
from __future__ import annotations

import logging
import os
from typing import ClassVar

from halserve.platforms.base import Platform, ProbeResult
from halserve.plugins import PluginManifest, hookimpl

logger = logging.getLogger(__name__)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the kernel.

    By default glibc serves every allocation above a threshold (at most 32 MiB) with a
    fresh mmap and unmaps it on free, so each prefill step's large activations (W1's
    2048 x 4096 float32 MLP output is 32 MiB) are page-faulted and zeroed by the kernel
    again every layer: measured 40% of a prefill step's time on W1, with most of the
    process's time in the kernel. vLLM's CPU worker gets the same effect by preloading
    tcmalloc. ``mallopt`` here is in-process, so it works for ``LLM(...)`` in a script too.
    Off with ``HALSERVE_CPU_MALLOC_TUNING=0``; a no-op where libc is not glibc.
    Returns whether the setting was applied.
    """
    if os.environ.get("HALSERVE_CPU_MALLOC_TUNING", "1") == "0":
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - raises AttributeError when not glibc
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    # Serve large blocks from the heap too; give memory back only when over 1 GiB is free
    # at the top of the heap (a dropped KV cache, not a step's activations).
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


def trim_heap() -> bool:
    """``malloc_trim(0)``: give the free memory of every glibc malloc arena back to the kernel.
    Returns False where libc is not glibc (nothing done)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        malloc_trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim(0)
    return True


MADV_HUGEPAGE = 14


def advise_huge_pages(tensor) -> bool:
    """Ask the kernel to back ``tensor``'s memory with transparent huge pages (2 MiB),
    for the whole 2 MiB-aligned part of it; call before the memory is first touched.
    Returns whether madvise succeeded (False off Linux or when THP is disabled)."""
    import ctypes

    size = tensor.numel() * tensor.element_size()
    start = tensor.data_ptr()
    huge = 2 << 20
    lo, hi = (start + huge - 1) & ~(huge - 1), (start + size) & ~(huge - 1)
    if hi <= lo:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return False
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(lo, hi - lo, MADV_HUGEPAGE) == 0


def _num_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    ray_device_key = "CPU"
    priority = 0  # the fallback: every accelerator outranks it
    supported_dtypes = ("float32", "bfloat16", "float16")
    default_dtype = "float32"
    fp8_dtype = None
    preferred_attention_backends = ("cpu_native", "torch")
    description = "CPU through torch (uses all cores by default)"

    @classmethod
    def _probe(cls) -> ProbeResult:
        return ProbeResult(True, f"{_num_cores()} CPU cores available")

    # A 16-bit model dtype is only fast on a CPU that multiplies it natively: without these
    # flags every bf16/fp16 GEMM and attention step converts to float32 and back (measured on
    # an AVX2-only EPYC: SmolLM2-135M at 64 sequences 4x slower in bf16 than in float32).
    _NATIVE_16BIT_FLAGS: ClassVar[dict[str, tuple[str, ...]]] = {
        "bfloat16": ("avx512_bf16", "amx_bf16"),
        "float16": ("avx512_fp16", "amx_fp16"),
    }

    @classmethod
    def auto_dtype(cls, checkpoint_dtype: str | None) -> tuple[str, str]:
        """``auto`` computes in the dtype that is fastest on this CPU: a bf16/fp16 checkpoint runs
        in that dtype only where the CPU has native dot products for it, else in float32."""
        native = cls._NATIVE_16BIT_FLAGS.get(checkpoint_dtype or "")
        if native is None or checkpoint_dtype not in cls.supported_dtypes:
            return super().auto_dtype(checkpoint_dtype)
        from halserve.platforms.cpu_kernels.panel import cpu_flags

        found = [flag for flag in native if flag in cpu_flags()]
        if found:
            return checkpoint_dtype, f"the checkpoint's dtype; this CPU computes it natively ({', '.join(found)})"
        return "float32", (
            f"the checkpoint is {checkpoint_dtype} but this CPU has no native {checkpoint_dtype} dot product "
            f"(none of {', '.join(native)} in /proc/cpuinfo), so float32 is faster here; pass --dtype "
            f"{checkpoint_dtype} to compute in {checkpoint_dtype} anyway"
        )

    def __init__(self) -> None:
        import torch

        # All cores by default; HALSERVE_CPU_THREADS overrides (e.g. one rank per socket).
        threads = int(os.environ.get("HALSERVE_CPU_THREADS", _num_cores()))
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        keep_freed_memory()

    def release_memory(self) -> None:
        """Free tensors go back to glibc's heap, not to the OS (``keep_freed_memory`` keeps up to 1 GiB
        at its top, and frees in its middle never shrink it): ``malloc_trim(0)`` returns every free page
        of every arena to the kernel, so the process's RSS drops by what sleep freed."""
        import gc

        gc.collect()
        if not trim_heap():
            logger.warning("sleep: could not call malloc_trim (libc is not glibc); freed memory stays in this "
                           "process's heap, where the engine reuses it at wake_up")

    def offload_weights(self, model) -> None:
        """No-op: the weights already live in host memory (sleep level 1 drops only the KV cache here)."""

    def restore_weights(self, model) -> None:
        """No-op (``offload_weights`` moved nothing)."""

    def make_tp_communicator(self, group, rank: int, size: int):
        """Shared-memory all-reduce/all-gather when the ranks share this machine (``cpu_kernels/shm_comm.py``;
        ``HALSERVE_CPU_SHM_COMM=0`` keeps gloo)."""
        from halserve.platforms.cpu_kernels.shm_comm import make_shm_communicator

        return make_shm_communicator(group, rank, size)

    def device_count(self) -> int:
        return 1

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total

    def allocate_kv_cache(self, shape, dtype):
        """Zeroed memory the OS hands out as it is first written, on huge pages where the kernel
        allows it. Anonymous mmap pages are zero by definition and take no RAM until touched, so the
        cache costs no start-up time (zeroing the default 4 GiB took ~4 s of every start) and the
        process's RSS grows with the blocks requests actually use, as llama.cpp's context does,
        instead of holding the whole budget from the start. Huge pages: decode attention reads
        every block of every running request per layer, blocks scattered over hundreds of MB, and
        with 4 KiB pages each 4 KiB (block, head) tile is its own TLB miss (measured ~8% faster
        decode attention on W1's shapes). The mapping is unmapped when the tensor is freed."""
        import math
        import mmap

        import torch

        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        cache = torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)
        advise_huge_pages(cache)
        return cache

    def kv_cache_budget(self, fraction: float) -> int:
        # Host memory is shared with everything else on the machine: like vLLM's
        # VLLM_CPU_KVCACHE_SPACE default, take at most 4 GiB unless told otherwise.
        free, _total = self.memory_info()
        return int(min(free * fraction * 0.5, 4 << 30))

    def memory_in_use(self, index: int = 0) -> int:
        """The process's resident set: on the CPU the "device memory" of --gpu-memory-utilization is the
        host's RAM, and the weights live in this process's RSS."""
        import psutil

        return psutil.Process().memory_info().rss

    def kv_cache_budget_of_total(self, utilization: float) -> int:
        # The share of total RAM, capped at what is available now (RAM other programs hold is not ours).
        budget = super().kv_cache_budget_of_total(utilization)
        available, total = self.memory_info()
        logger.info("--gpu-memory-utilization %s on the CPU: %.1f GiB of host RAM x %s less this process's "
                    "%.1f GiB = %.1f GiB for the KV cache%s", utilization, total / (1 << 30), utilization,
                    self.memory_in_use() / (1 << 30), budget / (1 << 30),
                    f" (capped at the {available / (1 << 30):.1f} GiB available)" if budget > available else "")
        return min(budget, available)


@hookimpl
def halserve_manifest() -> PluginManifest:
    return PluginManifest(name="cpu", version="0.1.0", api=">=1,<3", description=CpuPlatform.description)


@hookimpl
def halserve_platforms() -> list[type]:
    return [CpuPlatform]


@hookimpl
def halserve_attention_backends() -> list[type]:
    from halserve.attention_backends.cpu_native import CpuNativeAttentionBackend

    return [CpuNativeAttentionBackend]


@hookimpl
def halserve_kernels() -> list[type]:
    from halserve.platforms.cpu_kernels.fused import (
        CpuFusedRmsNorm,
        CpuFusedRotaryEmbedding,
        CpuFusedSiluAndMul,
        CpuScaledInt8Quant,
    )
    from halserve.platforms.cpu_kernels.native_fp8 import (
        NativeFp8BlockScaledGemm,
        NativeFp8ScaledGemm,
        NativePerTokenGroupFp8Quant,
        NativeScaledFp8Quant,
    )
    from halserve.platforms.cpu_kernels.native_gguf import NativeGgufGemm
    from halserve.platforms.cpu_kernels.native_int4 import NativeInt4AwqGemm, NativeInt4GptqGemm
    from halserve.platforms.cpu_kernels.native_int8 import NativeInt8ScaledGemm
    from halserve.platforms.cpu_kernels.onednn_gemm import OneDnnGemm
    from halserve.platforms.cpu_kernels.onednn_int8_gemm import OneDnnInt8ScaledGemm
    from halserve.platforms.cpu_kernels.quant_gemm import CpuInt4AwqGemm, CpuInt4GptqGemm, CpuInt8ScaledGemm

    return [OneDnnGemm, CpuFusedRmsNorm, CpuFusedRotaryEmbedding, CpuFusedSiluAndMul,
            CpuInt4GptqGemm, CpuInt4AwqGemm, NativeInt4GptqGemm, NativeInt4AwqGemm, NativeFp8ScaledGemm,
            NativeFp8BlockScaledGemm, NativeScaledFp8Quant, NativePerTokenGroupFp8Quant, CpuInt8ScaledGemm,
            OneDnnInt8ScaledGemm, NativeInt8ScaledGemm, CpuScaledInt8Quant, NativeGgufGemm]
