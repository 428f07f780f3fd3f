"""The native CPU kernels' AVX2 path, built and tested on whatever x86 CPU runs the suite.

A machine with AVX-512 compiles the kernels with ``-march=native`` and never runs the code an
AVX2-only CPU gets, where the 16-lane vectors are pairs of 8-lane ones (vec16.h). With
``HALSERVE_CPU_MARCH=x86-64-v3`` the same kernels build for AVX2 only (their own cache entry), and
the kernel tests run against that build in a child process."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from halserve.platforms import cpu_kernels
from halserve.platforms.cpu_kernels.build import MARCH_ENV, compile_flags
from halserve.platforms.cpu_kernels.panel import cpu_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _has_avx2() -> bool:
    return "avx2" in cpu_flags()


def test_march_override_is_validated(monkeypatch):
    monkeypatch.setenv(MARCH_ENV, "x86-64-v3")
    assert "-march=x86-64-v3" in compile_flags()
    monkeypatch.setenv(MARCH_ENV, "")
    assert "-march=native" in compile_flags()
    monkeypatch.setenv(MARCH_ENV, "native; rm -rf /")
    with pytest.raises(ValueError, match="HALSERVE_CPU_MARCH.*not a -march value"):
        compile_flags()


@pytest.mark.extended
@pytest.mark.slow  # builds the core and fp8 libraries for AVX2 once per machine (~1-2 min), then ~15 s
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not _has_avx2(),
                    reason="the AVX2 build needs an x86-64 CPU with AVX2")
@pytest.mark.skipif(cpu_kernels.toolchain_missing() is not None,
                    reason=f"no C++ toolchain: {cpu_kernels.toolchain_missing()}")
def test_kernels_built_for_avx2_only_match_the_references():
    env = dict(os.environ, **{MARCH_ENV: "x86-64-v3"})
    files = ["tests/attention_backends/test_cpu_native.py", "tests/platforms/test_cpu_kernel_libraries.py",
             "tests/platforms/test_cpu_native_fp8.py", "tests/platforms/test_cpu_native_gguf.py"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=800)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
    assert proc.returncode == 0, f"the AVX2 build's kernel tests failed:\n{tail}"
    assert " passed" in tail and " failed" not in tail, tail
