"""Native CPU kernels of the cpu platform, compiled on first use with torch's C++
extension builder (g++ and ninja; ``build.py`` caches each build, safe across processes)."""
from __future__ import annotations

import logging
import os
import shutil
import threading

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_module = None
_error: str | None = None


def toolchain_missing() -> str | None:
    """Why the native kernels cannot be built here, or None (cheap: no compile)."""
    for tool in ("g++", "ninja"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (needed to build halserve's native CPU kernels)"
    return None


def load() -> object | None:
    """The compiled extension module, building it once per machine; None (with the reason
    in ``load_error()``) when it cannot be built."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    with _lock:
        if _module is not None or _error is not None:
            return _module
        missing = toolchain_missing()
        if missing:
            _error = missing
            return None
        try:
            from halserve.platforms.cpu_kernels.build import HERE, build_and_load

            names = ("paged_attention.cpp", "paged_prefill.cpp", "elementwise.cpp", "shm_comm.cpp", "panel_gemm.cpp",
                     "int4_gemm.cpp", "int4_gemv.cpp", "fp8_gemm.cpp", "fp8_quant.cpp")
            logger.info("building halserve's native CPU kernels (once per machine)")
            _module = build_and_load("halserve_cpu_paged_attention", [os.path.join(HERE, name) for name in names])
        except Exception as exc:  # noqa: BLE001 - a failed build falls back, loudly
            _error = f"building the native CPU kernel failed: {type(exc).__name__}: {exc}"
            logger.warning(_error)
    return _module


def load_error() -> str | None:
    return _error
