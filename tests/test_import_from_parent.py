"""`import halserve` from the folder that holds a clone named ``halserve/``.

That folder is on ``sys.path`` ahead of the editable install's finder, so Python finds the
clone itself first; the root ``__init__.py`` turns it into the real package (its docstring
says how). Without it, ``from halserve import LLM`` failed with "cannot import name 'LLM'
from 'halserve' (unknown location)".
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys
from halserve import LLM, SamplingParams
import halserve
import halserve.platforms.cpu
import halserve.scheduler
print(json.dumps({
    "file": halserve.__file__,
    "path": list(halserve.__path__),
    "platforms_cpu": halserve.platforms.cpu.__file__,
    "scheduler": halserve.scheduler.__file__,
    "llm_module": LLM.__module__,
    "sampling_params": SamplingParams.__module__,
    "version": halserve.__version__,
}))
"""


def test_import_halserve_from_the_clones_parent_folder(tmp_path):
    (tmp_path / "halserve").symlink_to(REPO, target_is_directory=True)
    (tmp_path / "use_it.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "use_it.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"importing halserve next to a clone failed:\n{proc.stderr}"
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    clone = tmp_path / "halserve"
    # the clone (found through the script's folder) is the package, not the installed finder's mapping
    assert got["file"] == str(clone / "core" / "__init__.py"), got
    assert got["path"] == [str(clone / "core"), str(clone)], got
    assert got["platforms_cpu"] == str(clone / "platforms" / "cpu.py"), got
    assert got["scheduler"] == str(clone / "core" / "scheduler.py"), got
    assert got["llm_module"] == "halserve.entrypoints.llm"
    assert got["sampling_params"] == "halserve.sampling_params"
    assert got["version"]


def test_root_init_does_nothing_under_another_name(tmp_path):
    """pytest may import the clone's root as a package named after its folder: no side effect."""
    (tmp_path / "someclone").symlink_to(REPO, target_is_directory=True)
    code = "import someclone, json; print(json.dumps(sorted(k for k in vars(someclone) if not k.startswith('__'))))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
    assert "halserve" not in proc.stderr
