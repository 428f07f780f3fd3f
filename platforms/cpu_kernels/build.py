"""Build (once per machine) and load the cpu platform's C++ extensions, safely across processes.

``torch.utils.cpp_extension.load`` guards its build directory with a lock *file* that it creates and
deletes itself: a process killed mid-build (a timed-out test, a Ctrl-C'd server) leaves it behind and
every later build then waits on it forever. Two checkouts of different sources sharing one directory
also rebuild over each other. So each extension builds in a directory of its own per input: a hash of
its sources, the headers beside them, the flags, torch's version and this CPU (``-march=native``) names
it. Processes take turns through ``flock`` on a lock that the OS releases when its holder dies; whoever
holds it clears a stale torch lock before building.
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
CFLAGS = ("-O3", "-march=native", "-fopenmp")  # -fopenmp: at::parallel_for's pragmas need it
LDFLAGS = ("-fopenmp",)


def extensions_root() -> str:
    """Where builds are cached: ``$TORCH_EXTENSIONS_DIR`` if set, else ``~/.cache/halserve/cpu_kernels``."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "halserve", "cpu_kernels")
    return root


def _cpu_identity() -> bytes:
    """What ``-march=native`` compiles for: the CPU model and feature flags (empty off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            wanted = [line for line in f if line.startswith(("model name", "flags"))][:2]
        return "".join(wanted).encode()
    except OSError:
        return b""


def build_key(sources: list[str]) -> str:
    """A hash of everything the build's output depends on."""
    digest = hashlib.sha256()
    for path in sorted(set(sources) | set(glob.glob(os.path.join(HERE, "*.h")))):
        digest.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(repr((CFLAGS, LDFLAGS, torch.__version__)).encode())
    digest.update(_cpu_identity())
    return digest.hexdigest()[:16]


def build_and_load(name: str, sources: list[str], *, is_python_module: bool = True):
    """``torch.utils.cpp_extension.load`` of ``sources`` as ``name``, in this input's own directory, one
    process at a time; returns what ``load`` does (the module, or its path when not a Python module)."""
    from torch.utils.cpp_extension import load as load_ext

    directory = os.path.join(extensions_root(), f"{name}_{build_key(sources)}")
    os.makedirs(directory, exist_ok=True)
    with open(directory + ".flock", "a+") as guard:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that is building %s", name)
            started = time.monotonic()
            fcntl.flock(guard, fcntl.LOCK_EX)
            logger.info("%s was built by another process (waited %.0f s)", name, time.monotonic() - started)
        try:
            stale = os.path.join(directory, "lock")
            if os.path.exists(stale):  # left by a process killed mid-build: nobody else can hold it now
                logger.warning("removing a stale build lock left by a killed process: %s", stale)
                os.remove(stale)
            return load_ext(name=name, sources=sources, build_directory=directory,
                            extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                            is_python_module=is_python_module, verbose=False)
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)
