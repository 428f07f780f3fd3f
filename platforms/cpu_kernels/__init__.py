"""Native CPU kernels of the cpu platform, compiled on first use with torch's C++ extension builder
(g++ and ninja; ``build.py`` caches each build, safe across processes).

The C++ is split into libraries, each built the first time a kernel that needs it is resolved (a
layer's op at model load, an attention backend), so that a model builds only what it runs: a float32
or bfloat16 model builds ``core`` alone; a GPTQ/AWQ model adds ``int4``, an fp8 model ``fp8``, a W8A8
model ``int8``. Each build is cached per machine (``HALSERVE_KERNEL_CACHE``, see ``build.py``).

A wheel built with ``HALSERVE_PREBUILD_CPU_KERNELS`` (``scripts/build_wheel.sh``) ships every library of
``prebuilt_libraries()`` precompiled per x86 ISA level; ``prebuilt.py`` picks this CPU's, and nothing is
compiled (no g++ needed) where it matches this torch and these sources.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelLibrary:
    """One C++ extension of the cpu platform: what it is built from and what it gives."""

    build_name: str  # the extension's name: its cache directory and .so are named after it
    sources: tuple[str, ...]  # .cpp files beside this module (the .h files are part of every build's key)
    purpose: str  # what the library provides, for logs ("attention and fused elementwise kernels")
    is_python_module: bool = False  # True: a pybind module (returned by load); False: TORCH_LIBRARY ops only
    defines: tuple[str, ...] = ()  # -D flags
    estimate_s: float = 30.0  # build time measured on a 2-core AMD EPYC (Zen 4, AVX-512): the estimate
    # shown until this machine has built the library once


# Each op may be registered once per process, so a source compiled into two libraries (panel_gemm.cpp,
# the panel GEMM that the int4 and fp8 GEMMs share) registers its ISA query under a name per library.
LIBRARIES: dict[str, KernelLibrary] = {
    "core": KernelLibrary(
        "halserve_cpu_core", ("paged_attention.cpp", "paged_prefill.cpp", "elementwise.cpp", "shm_comm.cpp",
                              "decode_plan.cpp"),
        "paged attention, fused norm/rotary/activation, int8 activation quant, shared-memory collectives, the "
        "Llama decode plan",
        is_python_module=True, estimate_s=35.0),
    "int4": KernelLibrary(
        "halserve_cpu_int4", ("panel_gemm.cpp", "int4_gemm.cpp", "int4_gemv.cpp"),
        "the 4-bit (GPTQ/AWQ) panel GEMM", defines=("HALSERVE_PANEL_ISA_OP=int4_panel_gemm_isa",),
        estimate_s=15.0),
    "fp8": KernelLibrary(
        "halserve_cpu_fp8", ("panel_gemm.cpp", "fp8_gemm.cpp", "fp8_quant.cpp"),
        "the fp8 panel GEMM and fp8 activation quant", defines=("HALSERVE_PANEL_ISA_OP=fp8_panel_gemm_isa",),
        estimate_s=15.0),
    "int8": KernelLibrary("halserve_cpu_int8_gemm", ("int8_gemm.cpp",), "the AMX int8 (W8A8) GEMM", estimate_s=15.0),
    "mla": KernelLibrary("halserve_cpu_mla", ("mla_decode.cpp",),
                         "MLA (DeepSeek) decode attention over the paged latent cache", estimate_s=15.0),
}

# Built by native_gguf.py (load_gguf_ops, straight through build.build_and_load), not load_library; named
# here so that a wheel ships it prebuilt with the others.
GGUF_LIBRARY = KernelLibrary("halserve_cpu_gguf_gemm", ("gguf_gemm.cpp",),
                             "the GGUF (llama.cpp) quantized GEMM", estimate_s=13.0)


def prebuilt_libraries() -> list[KernelLibrary]:
    """What a wheel built with ``HALSERVE_PREBUILD_CPU_KERNELS`` ships precompiled: every library."""
    return [*LIBRARIES.values(), GGUF_LIBRARY]


_lock = threading.Lock()
_loaded: dict[str, object] = {}  # library -> the module (pybind) or the .so path (ops only)
_errors: dict[str, str] = {}  # library -> why it could not be built


def toolchain_missing() -> str | None:
    """Why the native kernels can be neither built nor loaded prebuilt here, or None (cheap: no compile).
    A wheel's prebuilt libraries for this CPU, torch and Python (``prebuilt.py``) need no toolchain."""
    for tool in ("g++", "ninja"):
        if shutil.which(tool) is None:
            from halserve.platforms.cpu_kernels.prebuilt import usable_level

            if usable_level() is not None:
                return None
            return f"{tool} is not installed (needed to build halserve's native CPU kernels)"
    return None


def _library(name: str) -> KernelLibrary:
    if name not in LIBRARIES:
        raise ValueError(f"unknown native CPU kernel library {name!r}; the libraries are: {', '.join(LIBRARIES)}")
    return LIBRARIES[name]


def load_library(name: str) -> object | None:
    """Build (once per machine, cached) and load library ``name``; returns the pybind module (``core``) or
    the .so's path (libraries of TORCH_LIBRARY ops, registered under ``torch.ops.halserve_cpu*`` once
    loaded), or None with the reason in ``load_error(name)`` when it cannot be built."""
    lib = _library(name)
    if name in _loaded or name in _errors:
        return _loaded.get(name)
    with _lock:
        if name in _loaded or name in _errors:
            return _loaded.get(name)
        missing = toolchain_missing()
        if missing:
            _errors[name] = missing
            return None
        try:
            from halserve.platforms.cpu_kernels.build import HERE, build_and_load

            _loaded[name] = build_and_load(
                lib.build_name, [os.path.join(HERE, s) for s in lib.sources], is_python_module=lib.is_python_module,
                defines=lib.defines, label=f"halserve's native CPU kernels '{name}'", purpose=lib.purpose,
                estimate_s=lib.estimate_s)
        except Exception as exc:  # noqa: BLE001 - a failed build falls back, loudly
            _errors[name] = f"building the native CPU kernel library {name!r} failed: {type(exc).__name__}: {exc}"
            logger.warning(_errors[name])
    return _loaded.get(name)


def loaded_libraries() -> list[str]:
    """The libraries this process has loaded so far, in load order."""
    return list(_loaded)


def load() -> object | None:
    """The ``core`` library's pybind module (attention, fused ops, collectives), built once per machine;
    None (with the reason in ``load_error()``) when it cannot be built."""
    return load_library("core")


def load_error(name: str = "core") -> str | None:
    return _errors.get(name)
