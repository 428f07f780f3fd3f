"""halserve's wheel holds every subpackage and works on its own.

Builds the wheel from a copy of the working tree, compares its listing with the package
list setup.py computes, installs it into a fresh virtual environment and, there, imports
every subpackage and runs ``halserve plugins --json``.

The venv is created with ``--system-site-packages`` (torch and the other dependencies
come from the system, nothing is downloaded); the test proves that every halserve module
imported there comes from the venv's own copy, not from the system's editable install.
"""
from __future__ import annotations

import glob
import json
import os
import runpy
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUNDLED_PLUGINS = {"builtin", "cpu", "cuda", "rocm", "xpu", "tpu"}


def _setup_kwargs(src: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """What setup.py passes to setuptools.setup() (its computed package list included)."""
    import setuptools

    captured: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
    runpy.run_path(str(src / "setup.py"), run_name="__main__")
    assert captured, "setup.py did not call setuptools.setup()"
    return captured


def _package_folder(src: Path, package: str, package_dir: dict[str, str]) -> Path:
    """The source folder of ``package`` under setup.py's ``package_dir`` mapping."""
    top = max((n for n in package_dir if package == n or package.startswith(n + ".")), key=len)
    rest = package[len(top):].lstrip(".")
    return src / package_dir[top] / Path(*rest.split(".")) if rest else src / package_dir[top]


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HALSERVE_") and k != "PYTHONPATH"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("packaging")
    src = work / "src"
    src.mkdir()
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    with pytest.MonkeyPatch.context() as mp:
        folders = set(_setup_kwargs(REPO, mp)["package_dir"].values())
    for folder in folders:
        shutil.copytree(REPO / folder, src / folder, ignore=ignore)
    # Everything below compares against this snapshot, so files other people add to the
    # checkout while the test runs cannot make it flaky.
    with pytest.MonkeyPatch.context() as mp:
        kwargs = _setup_kwargs(src, mp)
    wheels = work / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(src)])
    (wheel,) = wheels.glob("halserve-*.whl")
    return {"wheel": wheel, "kwargs": kwargs, "work": work, "src": src}


def test_setup_finds_every_package_folder(built: dict) -> None:
    """setup.py's package list is exactly the folders with an __init__.py under the roots."""
    kwargs = built["kwargs"]
    expected = set()
    for name, folder in kwargs["package_dir"].items():
        root = built["src"] / folder
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            if any(part == "__pycache__" or part.startswith(".") for part in rel.parts):
                continue
            # a folder counts only if every folder above it (up to the root) is a package too
            if all((root / Path(*rel.parts[:i]) / "__init__.py").exists() for i in range(len(rel.parts))):
                expected.add(".".join([name, *rel.parts]))
    assert set(kwargs["packages"]) == expected
    assert {"halserve", "halserve.platforms", "halserve.plugins", "halserve.attention_backends"} <= expected


def test_wheel_holds_every_subpackage(built: dict) -> None:
    kwargs = built["kwargs"]
    with zipfile.ZipFile(built["wheel"]) as zf:
        names = set(zf.namelist())
        missing = [p for p in kwargs["packages"] if p.replace(".", "/") + "/__init__.py" not in names]
        assert not missing, f"the wheel lacks these packages: {missing}"
        # every module of every package, not just the __init__ files
        for package in kwargs["packages"]:
            for module in _package_folder(built["src"], package, kwargs["package_dir"]).glob("*.py"):
                assert f"{package.replace('.', '/')}/{module.name}" in names, f"{module} is not in the wheel"
        # package data (the bundled demo model and chat template) when present in the tree
        for package, patterns in kwargs.get("package_data", {}).items():
            top_folder = _package_folder(built["src"], package, kwargs["package_dir"])
            for pattern in patterns:
                for path in glob.glob(str(top_folder / pattern)):
                    if os.path.isfile(path):
                        rel = Path(path).relative_to(top_folder)
                        assert f"{package.replace('.', '/')}/{rel.as_posix()}" in names, f"{path} is not in the wheel"
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        text = zf.read(entry_points).decode()
    assert "halserve = halserve.entrypoints.cli:main" in text
    section = text.split("[halserve.plugins]", 1)[1].split("[", 1)[0]
    registered = {line.split("=")[0].strip() for line in section.splitlines() if "=" in line}
    assert BUNDLED_PLUGINS <= registered


def test_installed_wheel_imports_and_runs(built: dict) -> None:
    venv = built["work"] / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(built["wheel"])])

    packages = built["kwargs"]["packages"]
    script = (
        "import importlib, json, sys\n"
        "out = {}\n"
        "for name in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        out[name] = importlib.import_module(name).__file__\n"
        "    except Exception as exc:\n"
        "        out[name] = 'ERROR ' + type(exc).__name__ + ': ' + str(exc)\n"
        "print(json.dumps(out))\n"
    )
    files = json.loads(_run([str(python), "-c", script, json.dumps(packages)], cwd=built["work"]).stdout)
    errors = {n: f for n, f in files.items() if f.startswith("ERROR")}
    assert not errors, f"these packages fail to import from the wheel: {errors}"
    # every one of them comes from the venv, not from the system's editable checkout
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    outside = {n: f for n, f in files.items() if not Path(f).resolve().is_relative_to(site.resolve())}
    assert not outside, f"imported from outside the venv ({site}): {outside}"

    halserve = venv / "bin" / "halserve"
    assert halserve.exists(), "the wheel did not install the halserve console script"
    proc = _run([str(halserve), "plugins", "--json"], cwd=built["work"])
    report = json.loads(proc.stdout)
    assert report["selected_platform"] == next(p["name"] for p in report["platforms"] if p["available"])
    plugins = {p["name"]: p for p in report["plugins"]}
    assert BUNDLED_PLUGINS <= set(plugins)
    assert plugins["cpu"]["status"] == "loaded"
    cpu_module = _run([str(python), "-c", "import halserve.platforms.cpu as m; print(m.__file__)"], cwd=built["work"]).stdout
    assert Path(cpu_module.strip()).resolve().is_relative_to(site.resolve())


# -- README and CI ---------------------------------------------------------------------
def _readme_commands() -> dict[str, str]:
    """The README's labelled set-up commands: label -> the one command line in its block."""
    text = (REPO / "README.md").read_text()
    commands = {}
    for chunk in text.split("Set-up command ")[1:]:
        label = chunk.split(" ", 1)[0]  # "1" or "2"
        block = chunk.split("```bash\n", 1)[1].split("```", 1)[0].strip()
        assert "\n" not in block, f"set-up command {label} must be one line, got:\n{block}"
        commands[label] = block
    return commands


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one() -> None:
    commands = _readme_commands()
    assert commands == {
        "1": "pip install torch==2.13.0 && pip install -e . && halserve serve",
        "2": 'pip install torch==2.13.0 && pip install -e ".[dev]" && HALSERVE_SKIP_ISOLATED=1 python -m pytest -q -m "not extended" --durations=25',
    }
    ci = (REPO / ".ci" / "run").read_text()
    assert ci.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in ci
    assert f"({commands['2']})" in ci
    # the extended suite: the README's separate command, run verbatim as .ci/run's own step
    extended = "python -m pytest -q -m extended --durations=10"
    assert f"```bash\n{extended}\n```" in (REPO / "README.md").read_text()
    assert f"({extended})" in ci
    # the isolated suites: the README's separate command, run verbatim as .ci/run's own step
    isolated = "python scripts/isolated_env.py test"
    assert f"```bash\n{isolated}\n```" in (REPO / "README.md").read_text()
    assert f"if {isolated}; then" in ci


@pytest.mark.parametrize(
    ("pytest_output", "pytest_status", "ci_ok"),
    [
        ("3 passed, 1 skipped in 0.50s", 0, True),
        ("1 failed, 2 passed in 0.50s", 1, False),
        ("no tests ran in 0.01s", 5, False),
    ],
)
def test_ci_run_fails_on_any_failure(tmp_path: Path, pytest_output: str, pytest_status: int, ci_ok: bool) -> None:
    """.ci/run with pip and python replaced by stubs: its exit status and summary line."""
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "pip").write_text("#!/bin/sh\necho \"pip $*\"\n")
    (shims / "python").write_text(f"#!/bin/sh\necho \"python $*\"\necho '{pytest_output}'\nexit {pytest_status}\n")
    for shim in shims.iterdir():
        shim.chmod(0o755)
    # the lint step runs the real linters: this test is about the test step's status
    env = {**os.environ, "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}", "CI": "true", "HALSERVE_SKIP_LINT": "1"}
    proc = subprocess.run(["bash", str(REPO / ".ci" / "run")], capture_output=True, text=True, env=env, timeout=60)
    assert "python -m pytest -q" in proc.stdout
    assert f"pytest summary: {pytest_output}" in proc.stdout
    assert (proc.returncode == 0) is ci_ok, proc.stdout + proc.stderr
    if not ci_ok:
        assert "FAILED" in proc.stderr
