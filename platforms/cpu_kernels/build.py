"""Build (once per machine and source version) and load the cpu platform's C++ extensions, safely
across processes, with progress while a build runs.

``torch.utils.cpp_extension.load`` guards its build directory with a lock *file* that it creates and
deletes itself: a process killed mid-build (a timed-out test, a Ctrl-C'd server) leaves it behind and
every later build then waits on it forever. Two checkouts of different sources sharing one directory
also rebuild over each other. So each extension builds in a directory of its own per input: a hash of
its sources, the headers beside them, the flags, torch's version and this CPU (``-march=native``) names
it; it compiles copies of the sources staged inside it (``stage_sources``), so that the same sources
reached through another path (a second checkout, an installed wheel) do not change ninja's build
command and recompile it. Processes take turns through ``flock`` on a lock that the OS releases when
its holder dies; whoever holds it clears a stale torch lock before building.

A build takes tens of seconds to minutes on a small machine, so while one runs a thread logs which
library, how many of its sources are compiled (ninja writes one ``.o`` per source), the time so far
and what is left of the estimate: this machine's last build of that library (``build_times.json`` in
the cache), else the figure measured on a 2-core machine that the library's entry in ``__init__.py``
ships. A build already in the cache is loaded, and logged as such, in well under a second.

Before any of that, a wheel built with ``HALSERVE_PREBUILD_CPU_KERNELS`` may hold the library precompiled
for this CPU's ISA level, this torch and these sources (``prebuilt.py``): it is loaded instead, and the
log says which (``using prebuilt avx512_bf16 kernels for torch 2.13.0+cpu``) or why none applies.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import subprocess
import threading
import time

import torch

from halserve.platforms.cpu_kernels import prebuilt
from halserve.platforms.cpu_kernels.prebuilt import LDFLAGS

logger = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
MARCH_ENV = "HALSERVE_CPU_MARCH"  # e.g. x86-64-v3: build for AVX2 only on an AVX-512 machine (to profile that path)
CACHE_ENV = "HALSERVE_KERNEL_CACHE"
PROGRESS_EVERY_S = 10.0  # seconds between progress lines while a build runs


def extensions_root() -> str:
    """Where builds are cached: ``$HALSERVE_KERNEL_CACHE``, else ``$TORCH_EXTENSIONS_DIR``, else
    ``~/.cache/halserve/cpu_kernels`` (point it at an empty folder to see what a first start costs)."""
    root = os.environ.get(CACHE_ENV) or os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "halserve", "cpu_kernels")
    return root


def compile_flags() -> tuple[str, ...]:
    """``-O3 -march=native -fopenmp`` (-fopenmp: at::parallel_for's pragmas need it); ``$HALSERVE_CPU_MARCH``
    replaces ``native`` (``x86-64-v3`` builds the AVX2 path on an AVX-512 machine, to measure it there)."""
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not march.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ValueError(f"{MARCH_ENV}={march!r} is not a -march value (e.g. native, x86-64-v3, skylake-avx512)")
    return ("-O3", f"-march={march}", "-fopenmp")


@functools.lru_cache(maxsize=8)
def _march_macros(march: str) -> frozenset[str]:
    try:
        out = subprocess.run(["c++", f"-march={march}", "-dM", "-E", "-x", "c++", os.devnull],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(line.split()[1] for line in out.splitlines() if line.startswith("#define "))


def target_has(macro: str) -> bool:
    """Whether the kernels' build target defines ``macro`` (e.g. ``__AVX512BF16__``): always for
    ``-march=native`` (the CPU's own flags decide), else what the compiler predefines for
    ``$HALSERVE_CPU_MARCH``."""
    march = compile_flags()[1].removeprefix("-march=")
    return march == "native" or macro in _march_macros(march)


def _cpu_identity() -> bytes:
    """What ``-march=native`` compiles for: the CPU model and feature flags (empty off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            wanted = [line for line in f if line.startswith(("model name", "flags"))][:2]
        return "".join(wanted).encode()
    except OSError:
        return b""


def build_key(sources: list[str], defines: tuple[str, ...] = ()) -> str:
    """A hash of everything the build's output depends on."""
    digest = hashlib.sha256()
    prebuilt.hash_files(digest, prebuilt.build_inputs(sources))  # what stage_sources copies
    flags = (compile_flags(), LDFLAGS, torch.__version__) + ((tuple(defines),) if defines else ())
    digest.update(repr(flags).encode())
    digest.update(_cpu_identity())
    return digest.hexdigest()[:16]


def stage_sources(directory: str, sources: list[str]) -> list[str]:
    """Copies of ``sources`` and the headers beside them in ``directory/src``; returns the sources' copies.

    ninja rebuilds when a build command changes, and torch's command names each source by its path:
    a second checkout, a CI clone or an installed wheel holding the same sources (so the same
    directory) would otherwise recompile it (~15 s for the GGUF kernels) every time the other one had
    loaded it last. The copies' paths are the same for everyone. A copy is only written when missing
    or different, so its mtime (which ninja also compares) stays put."""
    staged = os.path.join(directory, "src")
    os.makedirs(staged, exist_ok=True)
    for path in prebuilt.build_inputs(sources):
        target = os.path.join(staged, os.path.basename(path))
        with open(path, "rb") as f:
            data = f.read()
        try:
            with open(target, "rb") as f:
                same = f.read() == data
        except OSError:
            same = False
        if not same:
            with open(target + ".tmp", "wb") as f:
                f.write(data)
            os.replace(target + ".tmp", target)
    return [os.path.join(staged, os.path.basename(path)) for path in sources]


def build_directory(name: str, sources: list[str], defines: tuple[str, ...] = ()) -> str:
    return os.path.join(extensions_root(), f"{name}_{build_key(sources, defines)}")


def is_built(directory: str, name: str) -> bool:
    """Whether ``directory`` holds a finished build of ``name`` (ninja writes the library last)."""
    return os.path.isfile(os.path.join(directory, f"{name}.so")) and not os.path.exists(
        os.path.join(directory, "lock"))


def _times_path() -> str:
    return os.path.join(extensions_root(), "build_times.json")


def recorded_build_seconds(name: str) -> float | None:
    """How long this machine's last build of ``name`` took (any source version), or None."""
    try:
        with open(_times_path()) as f:
            value = json.load(f).get(name)
        return float(value) if value is not None else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _record_build_seconds(name: str, seconds: float) -> None:
    path = _times_path()
    try:
        with open(path) as f:
            times = json.load(f)
        if not isinstance(times, dict):
            times = {}
    except (OSError, ValueError):
        times = {}
    times[name] = round(seconds, 1)
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(times, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    except OSError:
        pass  # the estimate is a nicety; a read-only cache must not fail the build


def _object_name(source: str) -> str:
    return os.path.splitext(os.path.basename(source))[0] + ".o"  # how torch's build.ninja names objects


def progress_line(label: str, directory: str, sources: list[str], started: float, estimate_s: float | None) -> str:
    """One progress report: ``label``, sources compiled so far (their ``.o`` in ``directory``), the time so
    far, and what is left of ``estimate_s``."""
    done = sum(os.path.isfile(os.path.join(directory, _object_name(s))) for s in sources)
    elapsed = time.monotonic() - started
    if estimate_s is None:
        left = "no estimate yet"
    elif elapsed <= estimate_s:
        left = f"about {estimate_s - elapsed:.0f} s left of ~{estimate_s:.0f} s"
    else:
        left = f"past the ~{estimate_s:.0f} s estimate"
    return f"building {label}: {done} of {len(sources)} sources compiled, {elapsed:.0f} s elapsed, {left}"


class _Progress:
    """Logs ``progress_line`` every ``PROGRESS_EVERY_S`` seconds from a daemon thread until stopped."""

    def __init__(self, label: str, directory: str, sources: list[str], estimate_s: float | None) -> None:
        self.args = (label, directory, sources, time.monotonic(), estimate_s)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"progress-{label}", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(PROGRESS_EVERY_S):
            logger.info(progress_line(*self.args))

    def __enter__(self) -> _Progress:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def _load_prebuilt(name: str, sources: list[str], defines: tuple[str, ...], label: str):
    """The prebuilt library ``name`` loaded (``prebuilt.py``: a wheel's, for this CPU's ISA level, torch and
    sources), or None after logging why there is none to load."""
    found = prebuilt.find(name, sources, defines)
    if isinstance(found, str):
        # an editable install has none: saying so at every start would be noise
        log = logger.debug if found.startswith("there are none") else logger.info
        log("not using a prebuilt %s: %s", label, found)
        return None
    started = time.monotonic()
    try:
        result = prebuilt.load(found)
    except Exception as exc:  # noqa: BLE001 - a broken prebuilt library falls back to a build, loudly
        logger.warning("could not load the prebuilt %s (%s): %s: %s; building it instead", label, found.path,
                       type(exc).__name__, exc)
        return None
    logger.info("using prebuilt %s kernels for torch %s: %s (%s, loaded in %.1f s)", found.level,
                found.torch_version, label, found.path, time.monotonic() - started)
    return result


def build_and_load(name: str, sources: list[str], *, is_python_module: bool = True, defines: tuple[str, ...] = (),
                   label: str | None = None, purpose: str = "", estimate_s: float | None = None):
    """``torch.utils.cpp_extension.load`` of ``sources`` as ``name``, in this input's own directory, one
    process at a time; returns what ``load`` does (the module, or its path when not a Python module).
    A prebuilt library that matches (a wheel's, ``prebuilt.py``) is loaded instead, with no compiler.

    ``defines`` are ``-D`` flags (part of the cache key); ``label`` names the build in logs (default
    ``name``), ``purpose`` says what it gives in the first line; ``estimate_s`` is the expected build time
    where this machine has never built ``name``.
    """
    from torch.utils.cpp_extension import load as load_ext

    label = label or name
    loaded = _load_prebuilt(name, sources, defines, label)
    if loaded is not None:
        return loaded
    directory = build_directory(name, sources, defines)
    os.makedirs(directory, exist_ok=True)
    cflags = [*compile_flags(), *(f"-D{d}" for d in defines)]
    with open(directory + ".flock", "a+") as guard:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that is building %s", label)
            started = time.monotonic()
            fcntl.flock(guard, fcntl.LOCK_EX)
            logger.info("%s was built by another process (waited %.0f s)", label, time.monotonic() - started)
        try:
            stale = os.path.join(directory, "lock")
            if os.path.exists(stale):  # left by a process killed mid-build: nobody else can hold it now
                logger.warning("removing a stale build lock left by a killed process: %s", stale)
                os.remove(stale)
            started = time.monotonic()
            sources = stage_sources(directory, sources)
            if is_built(directory, name):
                library = os.path.join(directory, f"{name}.so")
                before = os.stat(library).st_mtime_ns
                result = load_ext(name=name, sources=sources, build_directory=directory, extra_cflags=cflags,
                                  extra_ldflags=list(LDFLAGS), is_python_module=is_python_module, verbose=False)
                if os.stat(library).st_mtime_ns != before:  # ninja found its build command changed
                    logger.info("rebuilt %s in %.0f s (%s: its build command had changed, e.g. another torch "
                                "install's include paths)", label, time.monotonic() - started, directory)
                else:
                    logger.info("using cached build of %s (%s, loaded in %.1f s)", label, directory,
                                time.monotonic() - started)
                return result
            estimate = recorded_build_seconds(name) or estimate_s
            logger.info("building %s%s: %d sources (%s), once per machine and source version%s; cached in %s",
                        label, f" ({purpose})" if purpose else "", len(sources),
                        ", ".join(os.path.basename(s) for s in sources),
                        f", about {estimate:.0f} s" if estimate else "", directory)
            with _Progress(label, directory, sources, estimate):
                result = load_ext(name=name, sources=sources, build_directory=directory, extra_cflags=cflags,
                                  extra_ldflags=list(LDFLAGS), is_python_module=is_python_module, verbose=False)
            seconds = time.monotonic() - started
            _record_build_seconds(name, seconds)
            logger.info("built %s in %.0f s", label, seconds)
            return result
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)
