"""Maps the repository's root folders into the one `halserve` import namespace.

Metadata lives in pyproject.toml; this file only computes the package list, so a new
subpackage (any folder with an ``__init__.py``) is picked up without editing a list.
"""
import os

from setuptools import setup

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


setup(
    packages=find_packages(),
    package_dir={name: folder for folder, name in ROOTS.items()},
    package_data={"halserve.demo": ["model/*", "*.jinja"], "halserve.platforms.cpu_kernels": ["*.cpp", "*.h"]},
)
