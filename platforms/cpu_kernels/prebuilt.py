"""The cpu platform's kernel libraries precompiled into a wheel, one set per x86 ISA level, and the runtime
choice among them (``build.build_and_load`` asks ``find`` before it compiles anything).

A wheel built with ``HALSERVE_PREBUILD_CPU_KERNELS=avx2,avx512,avx512_bf16,amx`` (``scripts/build_wheel.sh``)
holds ``prebuilt_libs/<level>/<library>.so`` and ``prebuilt_libs/manifest.json``, which records the torch
version, Python ABI and machine the libraries were built for and, per library, a hash of its sources. A
library is loaded only where all of them match this process, so an edited checkout or a different torch
never loads a stale build: it compiles on first use as before, and the log says why.

The levels, lowest first; a CPU gets the highest level whose flags it has, and only that level: a
lower one would lose kernels (the panel GEMM needs AVX512-BF16, the W8A8 GEMM AMX), so where the
wheel lacks this CPU's level the kernels build for ``-march=native`` instead::

    avx2         -march=x86-64-v3                      Haswell+, Zen 1-3: vec16.h's 2 x 8-lane path
    avx512       -march=x86-64-v4                      Skylake-X, Ice Lake: 16-lane attention/elementwise
    avx512_bf16  x86-64-v4 + AVX512-VNNI + AVX512-BF16 Cooper Lake, Zen 4/5: + the int4/fp8 panel GEMM
    amx          avx512_bf16 + AMX-TILE/BF16/INT8      Sapphire Rapids+: + AMX panel and W8A8 GEMMs

This module imports only the standard library and torch at the top, because ``setup.py`` loads it by
path to build the libraries before halserve is installed.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
PREBUILT_DIR = "prebuilt_libs"  # beside this module in an installed wheel
MANIFEST = "manifest.json"
FORMAT = 1  # the manifest's layout version
BUILD_ENV = "HALSERVE_PREBUILD_CPU_KERNELS"  # setup.py: the levels to build into the wheel ("avx2,avx512_bf16")
USE_ENV = "HALSERVE_PREBUILT_KERNELS"  # runtime: 0 ignores the prebuilt libraries; a folder replaces the wheel's
LDFLAGS = ("-fopenmp",)  # every kernel library's link flags (build.py compiles with the same)

_V3 = frozenset({"ssse3", "sse4_2", "popcnt", "cx16", "lahf_lm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma",
                 "abm", "movbe", "xsave"})  # x86-64-v3 (abm: how /proc/cpuinfo names LZCNT)
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_BF16 = _V4 | {"avx512_vnni", "avx512_bf16"}


@dataclass(frozen=True)
class IsaLevel:
    """One prebuilt instruction-set level."""

    name: str  # its folder in prebuilt_libs/ and its name in HALSERVE_PREBUILD_CPU_KERNELS
    march: tuple[str, ...]  # the compiler flags that replace -march=native
    cpu_flags: frozenset[str]  # the /proc/cpuinfo flags a CPU needs to run code built with ``march``


LEVELS: tuple[IsaLevel, ...] = (  # lowest first
    IsaLevel("avx2", ("-march=x86-64-v3",), _V3),
    IsaLevel("avx512", ("-march=x86-64-v4",), _V4),
    IsaLevel("avx512_bf16", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"), _BF16),
    IsaLevel("amx", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
             _BF16 | {"amx_tile", "amx_bf16", "amx_int8"}),
)
LEVEL_NAMES = tuple(level.name for level in LEVELS)


def level(name: str) -> IsaLevel:
    for candidate in LEVELS:
        if candidate.name == name:
            return candidate
    raise ValueError(f"unknown ISA level {name!r}; the levels are: {', '.join(LEVEL_NAMES)}")


def cpu_level(flags: frozenset[str] | set[str]) -> IsaLevel | None:
    """The highest level a CPU with ``flags`` runs, or None (no AVX2, or not x86)."""
    best = None
    for candidate in LEVELS:
        if candidate.cpu_flags <= flags:
            best = candidate
    return best


def compile_flags(isa: IsaLevel) -> tuple[str, ...]:
    """``build.compile_flags()`` with ``-march=native`` replaced by the level's flags."""
    return ("-O3", *isa.march, "-fopenmp")


def source_hash(sources: list[str] | tuple[str, ...], defines: tuple[str, ...] = ()) -> str:
    """A hash of what a library is built from: its sources, the headers beside them, its -D flags and the
    link flags (the compile flags are the level's, and torch's version is checked on its own)."""
    digest = hashlib.sha256()
    hash_files(digest, build_inputs(sources))
    digest.update(repr((tuple(defines), LDFLAGS)).encode())
    return digest.hexdigest()[:16]


def headers_beside(sources: list[str] | tuple[str, ...]) -> list[str]:
    """The ``.h`` files in the sources' folders: what their ``#include "..."`` can reach."""
    return sorted({os.path.join(folder, name) for folder in {os.path.dirname(os.path.abspath(s)) for s in sources}
                   for name in os.listdir(folder) if name.endswith(".h")})


def build_inputs(sources: list[str] | tuple[str, ...]) -> list[str]:
    """Every file a build compiles: the sources and the headers beside them, by file name (the order and the
    names a staged copy has, so the same files in another checkout give the same hash)."""
    return sorted(set(map(os.path.abspath, sources)) | set(headers_beside(sources)), key=os.path.basename)


def hash_files(digest, paths) -> None:
    """Feed each file's name and bytes, in the order given, to ``digest`` (a hashlib object); build.py's
    cache key does the same."""
    for path in paths:
        digest.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            digest.update(f.read())


def _abi() -> str:
    return sys.implementation.cache_tag or sys.implementation.name  # "cpython-311": the pybind module's ABI


def prebuilt_root() -> str | None:
    """The folder to load prebuilt libraries from: ``$HALSERVE_PREBUILT_KERNELS`` if it names one, else this
    package's ``prebuilt_libs``; None when ``HALSERVE_PREBUILT_KERNELS=0`` turns them off."""
    value = os.environ.get(USE_ENV, "").strip()
    if value.lower() in ("0", "false", "no", "off"):
        return None
    if value and value.lower() not in ("1", "true", "yes", "on"):
        return value
    return os.path.join(HERE, PREBUILT_DIR)


@dataclass(frozen=True)
class Prebuilt:
    """A prebuilt library that this process can load."""

    name: str  # the library's build name (halserve_cpu_core)
    path: str  # its .so
    level: str  # the ISA level it was built for
    torch_version: str  # the torch it was built against (this process's)
    is_python_module: bool  # a pybind module (imported) or TORCH_LIBRARY ops only (torch.ops.load_library)


def _read_manifest(root: str) -> dict | None:
    try:
        with open(os.path.join(root, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def _usable_level(manifest: dict, flags: frozenset[str]) -> tuple[str | None, str]:
    """(the manifest's level for this process, "") or (None, why none)."""
    built_for = {"torch": manifest.get("torch"), "Python": manifest.get("python"), "machine": manifest.get("machine")}
    here = {"torch": torch.__version__, "Python": _abi(), "machine": platform.machine()}
    for what, value in built_for.items():
        if value != here[what]:
            return None, f"they were built for {what} {value}, this is {what} {here[what]}"
    isa = cpu_level(flags)
    shipped = manifest.get("levels") or {}
    if isa is None:
        return None, f"this CPU has none of their ISA levels ({', '.join(shipped)}): it lacks AVX2"
    if isa.name not in shipped:
        return None, (f"this CPU's level is {isa.name} and they hold {', '.join(shipped) or 'none'} (a lower level "
                      f"would lose this CPU's kernels)")
    return isa.name, ""


def _cpu_flags() -> frozenset[str]:
    from halserve.platforms.cpu_kernels.panel import cpu_flags

    return cpu_flags()


def find(name: str, sources: list[str] | tuple[str, ...], defines: tuple[str, ...] = (), *,
         flags: frozenset[str] | None = None) -> Prebuilt | str:
    """The prebuilt ``name`` to load instead of building it, or why there is none (a sentence).

    ``flags`` are the CPU's (default: /proc/cpuinfo). ``$HALSERVE_CPU_MARCH`` (a build for a chosen
    target) and ``HALSERVE_PREBUILT_KERNELS=0`` turn prebuilt libraries off."""
    march = os.environ.get("HALSERVE_CPU_MARCH", "").strip()
    if march:
        return f"HALSERVE_CPU_MARCH={march} asks for a build for that target"
    root = prebuilt_root()
    if root is None:
        return f"{USE_ENV}={os.environ.get(USE_ENV)} turns them off"
    manifest = _read_manifest(root)
    if manifest is None:
        return f"there are none in {root} (an editable install, or a wheel built without {BUILD_ENV})"
    isa, why = _usable_level(manifest, _cpu_flags() if flags is None else flags)
    if isa is None:
        return why
    entry = manifest["levels"][isa].get("libraries", {}).get(name)
    if entry is None:
        return f"the {isa} set in {root} has no {name}"
    if entry.get("source_hash") != source_hash(sources, defines):
        return f"{name}'s sources differ from those the prebuilt {isa} library was built from"
    path = os.path.join(root, entry.get("file", ""))
    if not os.path.isfile(path):
        return f"{path} is missing"
    return Prebuilt(name, path, isa, torch.__version__, bool(entry.get("is_python_module")))


def usable_level(flags: frozenset[str] | None = None) -> str | None:
    """The prebuilt level this process would load from (None: none applies); cheap, loads nothing."""
    if os.environ.get("HALSERVE_CPU_MARCH", "").strip():
        return None
    root = prebuilt_root()
    manifest = _read_manifest(root) if root else None
    if manifest is None:
        return None
    return _usable_level(manifest, _cpu_flags() if flags is None else flags)[0]


def load(found: Prebuilt):
    """Load ``found`` as ``torch.utils.cpp_extension.load`` loads a build: the module, or the .so's path."""
    if not found.is_python_module:
        torch.ops.load_library(found.path)
        return found.path
    import importlib.util

    spec = importlib.util.spec_from_file_location(found.name, found.path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the prebuilt {found.name} from {found.path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Run in a child per library and level: torch's load() keeps per-process state by name (a second build
# of one name with other flags is renamed name_v1), and loading a library built for an ISA this machine
# lacks could fault, so the child builds without importing what it built.
_BUILD_CHILD = """
import json, sys
import torch.utils.cpp_extension as ce
spec = json.loads(sys.argv[1])
ce._import_module_from_library = lambda *args, **kwargs: None
ce.load(name=spec["name"], sources=spec["sources"], build_directory=spec["directory"], extra_cflags=spec["cflags"],
        extra_ldflags=spec["ldflags"], is_python_module=spec["is_python_module"], verbose=False)
"""


@dataclass(frozen=True)
class LibrarySpec:
    """What ``prebuild`` compiles: a library's build name, sources (paths), -D flags and kind."""

    name: str
    sources: tuple[str, ...]
    defines: tuple[str, ...] = ()
    is_python_module: bool = False


def parse_levels(value: str) -> list[IsaLevel]:
    """``"avx2,avx512_bf16"`` -> those levels (``all``: every level); a ValueError names a bad one."""
    names = LEVEL_NAMES if value.strip() == "all" else [v.strip() for v in value.split(",") if v.strip()]
    return [level(name) for name in names]


def prebuild(out_dir: str, levels: list[IsaLevel], libraries: list[LibrarySpec], *, log=print,
             lock: str | None = None) -> dict:
    """Compile every library for every level into ``out_dir/<level>/`` and write ``out_dir/manifest.json``
    (written last, so a failed build leaves no manifest); returns the manifest. ``lock``: a file to
    ``flock`` around each library's compile (a shared machine's CPU lock: one short turn per library)."""
    os.makedirs(out_dir, exist_ok=True)
    manifest: dict = {"format": FORMAT, "torch": torch.__version__, "python": _abi(), "machine": platform.machine(),
                      "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "levels": {}}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="halserve-prebuild-") as scratch:
        for isa in levels:
            entries = {}
            os.makedirs(os.path.join(out_dir, isa.name), exist_ok=True)
            for lib in libraries:
                directory = os.path.join(scratch, isa.name, lib.name)
                os.makedirs(directory)
                spec = {"name": lib.name, "sources": list(lib.sources), "directory": directory,
                        "cflags": [*compile_flags(isa), *(f"-D{d}" for d in lib.defines)], "ldflags": list(LDFLAGS),
                        "is_python_module": lib.is_python_module}
                hashed = source_hash(lib.sources, lib.defines)  # before compiling: an edit meanwhile then mismatches
                with open(lock or os.devnull, "a") as held:
                    if lock:
                        fcntl.flock(held, fcntl.LOCK_EX)
                    t0 = time.monotonic()
                    proc = subprocess.run([sys.executable, "-c", _BUILD_CHILD, json.dumps(spec)],
                                          capture_output=True, text=True)
                built = os.path.join(directory, f"{lib.name}.so")
                if proc.returncode != 0 or not os.path.isfile(built):
                    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
                    raise RuntimeError(f"building {lib.name} for {isa.name} ({' '.join(isa.march)}) failed:\n{tail}")
                file = f"{isa.name}/{lib.name}.so"
                shutil.copyfile(built, os.path.join(out_dir, file))
                seconds = time.monotonic() - t0
                entries[lib.name] = {"file": file, "source_hash": hashed,
                                     "is_python_module": lib.is_python_module, "build_s": round(seconds, 1)}
                log(f"prebuilt {lib.name} for {isa.name} ({' '.join(isa.march)}) in {seconds:.0f} s "
                    f"({time.monotonic() - started:.0f} s so far)")
            manifest["levels"][isa.name] = {"march": list(isa.march), "libraries": entries}
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    return manifest
