"""Fixtures for the plugin tests: the third-party fixture plugin, built into its own wheel, and
a plugin module a test built, installed in this process through a fake entry point.

The wheel is installed with ``pip install --target`` into a temporary folder that only
the subprocesses of these tests put on ``PYTHONPATH``, so the system Python (and every
other test) never sees the ``fixture`` plugin. Each scenario runs ``halserve`` in a fresh
subprocess because discovery happens once per process.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import pytest
from plugin_test_utils import clean_env

from halserve.plugins import PluginManager
from halserve.plugins import manager as manager_module

FIXTURE_SRC = Path(__file__).parent / "fixture_plugin"


@pytest.fixture(scope="session")
def fixture_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the installed fixture wheel (put it on PYTHONPATH to see the plugin)."""
    work = tmp_path_factory.mktemp("fixture_plugin")
    src = work / "src"
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    shutil.copytree(FIXTURE_SRC, src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    wheels = work / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(wheels), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, f"building the fixture wheel failed:\n{build.stdout}\n{build.stderr}"
    (wheel,) = wheels.glob("halserve_fixture_plugin-*.whl")
    site = work / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert install.returncode == 0, f"installing the fixture wheel failed:\n{install.stdout}\n{install.stderr}"
    assert (site / "halserve_fixture_plugin" / "__init__.py").is_file()
    return site


@pytest.fixture
def fixture_env(fixture_site: Path):
    """Build an environment in which the fixture plugin is installed: ``fixture_env(VAR=value)``."""

    def make(**extra: str) -> dict[str, str]:
        env = clean_env(**extra)
        env["PYTHONPATH"] = os.pathsep.join([str(fixture_site), *filter(None, [os.environ.get("PYTHONPATH")])])
        return env

    return make


@pytest.fixture
def install_plugin(monkeypatch: pytest.MonkeyPatch) -> Callable[..., PluginManager]:
    """``install_plugin(module)``: ``module`` installed as a vendor's plugin would be, through an entry
    point named "acme", then discovered afresh with builtin and cpu (``HALSERVE_PLUGINS``); returns the
    new process-wide manager, after checking that the plugin loaded and claims no name another plugin
    has (``must_load=False``: no check, for a plugin meant to fail). Installing again replaces the
    plugin; the test's end restores the manager and the environment."""
    real = metadata.entry_points  # (taken before any patch: a second install replaces the first)

    def install(plugin: types.ModuleType, must_load: bool = True) -> PluginManager:
        monkeypatch.setitem(sys.modules, plugin.__name__, plugin)

        def entry_points(**kwargs):  # (other groups unchanged: transformers reads some)
            eps = real(**kwargs)
            if kwargs.get("group") != manager_module.ENTRY_POINT_GROUP:
                return eps
            fake = metadata.EntryPoint(name="acme", value=plugin.__name__, group=kwargs["group"])
            return metadata.EntryPoints([*eps, fake])

        monkeypatch.setattr(manager_module.metadata, "entry_points", entry_points)
        monkeypatch.setenv("HALSERVE_PLUGINS", "builtin,cpu,acme")
        monkeypatch.delenv("HALSERVE_DISABLE_PLUGINS", raising=False)
        monkeypatch.delenv("HALSERVE_PLATFORM", raising=False)
        monkeypatch.setattr(manager_module, "_manager", None)
        mgr = manager_module.get_plugin_manager()
        if must_load:
            assert mgr.record("acme").status == "loaded", mgr.record("acme").error
            mgr.check_conflicts()
        return mgr

    return install
