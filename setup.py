"""Maps the repository's root folders into the one `halserve` import namespace.

Metadata lives in pyproject.toml; this file only computes the package list, so a new
subpackage (any folder with an ``__init__.py``) is picked up without editing a list.

``HALSERVE_PREBUILD_CPU_KERNELS=avx2,avx512,avx512_bf16,amx`` (or ``all``) also compiles the cpu
platform's kernel libraries for those ISA levels into the built package
(``halserve/platforms/cpu_kernels/prebuilt_libs``, see prebuilt.py) against the torch installed in the
build environment (so build with ``--no-build-isolation``), and tags the wheel for this Python and
platform; ``HALSERVE_PREBUILD_LOCK=<file>`` flocks it around each library's compile (a shared
machine's CPU lock). ``scripts/build_wheel.sh`` does that. Editable installs never prebuild.
"""
import importlib.util
import os
import shutil
import sys

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

# root folder -> import name (DESIGN.md section 1)
ROOTS = {
    # the hardware-agnostic core: config, requests, scheduler, KV-cache manager, engine
    "core": "halserve",
    # what runs a step: models and their layers, the op table, sampling, the worker
    "models": "halserve.models",
    "layers": "halserve.layers",
    "kernels": "halserve.kernels",
    "sampling": "halserve.sampling",
    "worker": "halserve.worker",
    "distributed": "halserve.distributed",
    # cross-cutting features
    "lora": "halserve.lora",
    "multimodal": "halserve.multimodal",
    "spec_decode": "halserve.spec_decode",
    "structured_output": "halserve.structured_output",
    # what users touch: LLM, the OpenAI server, the CLI, the bench client, the demo model
    "entrypoints": "halserve.entrypoints",
    "bench": "halserve.bench",
    "demo": "halserve.demo",
    # plugin kinds, each with its base.py
    "platforms": "halserve.platforms",
    "attention_backends": "halserve.attention_backends",
    "quant_methods": "halserve.quant_methods",
    "executors": "halserve.executors",
    "kv_connectors": "halserve.kv_connectors",
    "plugins": "halserve.plugins",
}


def find_packages() -> list[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    packages = []
    for folder, import_name in ROOTS.items():
        root = os.path.join(here, folder)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")]
            if "__init__.py" not in filenames:
                dirnames[:] = []
                continue
            rel = os.path.relpath(dirpath, root)
            packages.append(import_name if rel == "." else import_name + "." + rel.replace(os.sep, "."))
    return packages


def _load_by_path(name: str, path: str):
    """A module from this tree without importing halserve (not installed yet where this runs)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


PREBUILD_ENV = "HALSERVE_PREBUILD_CPU_KERNELS"


class BuildPyWithKernels(build_py):
    """build_py, then (with ``$HALSERVE_PREBUILD_CPU_KERNELS``) the kernel libraries into build_lib."""

    def run(self):
        super().run()
        kernels = os.path.join(os.path.dirname(os.path.abspath(__file__)), "platforms", "cpu_kernels")
        target = os.path.join(self.build_lib, "halserve", "platforms", "cpu_kernels", "prebuilt_libs")
        shutil.rmtree(target, ignore_errors=True)  # an earlier wheel's libraries must not ride along
        levels = os.environ.get(PREBUILD_ENV, "").strip()
        if not levels or getattr(self, "editable_mode", False):
            return
        prebuilt = _load_by_path("_halserve_prebuilt", os.path.join(kernels, "prebuilt.py"))
        registry = _load_by_path("_halserve_cpu_kernels", os.path.join(kernels, "__init__.py"))
        libraries = [prebuilt.LibrarySpec(lib.build_name, tuple(os.path.join(kernels, s) for s in lib.sources),
                                          lib.defines, lib.is_python_module)
                     for lib in registry.prebuilt_libraries()]
        prebuilt.prebuild(target, prebuilt.parse_levels(levels), libraries, log=lambda line: print(line, flush=True),
                          lock=os.environ.get("HALSERVE_PREBUILD_LOCK") or None)


class KernelDistribution(Distribution):
    def has_ext_modules(self):  # prebuilt native libraries: a platform wheel (cpXY-cpXY-linux_x86_64)
        return bool(os.environ.get(PREBUILD_ENV, "").strip())


setup(
    distclass=KernelDistribution,
    cmdclass={"build_py": BuildPyWithKernels},
    packages=find_packages(),
    package_dir={name: folder for folder, name in ROOTS.items()},
    package_data={"halserve.demo": ["model/*", "*.jinja"], "halserve.platforms.cpu_kernels": ["*.cpp", "*.h"]},
)
