"""scripts/isolated_env.py bookkeeping and the xpu/tpu plugin surfaces that need no vendor
library (default suite; nothing is built or downloaded here)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "isolated_env.py"


def _script():
    spec = importlib.util.spec_from_file_location("isolated_env", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_venv_path_is_outside_the_repo_keyed_by_the_requirements(monkeypatch, tmp_path):
    mod = _script()
    monkeypatch.setenv("HALSERVE_VENV_DIR", str(tmp_path))
    ipex, xla = mod.venv_path("ipex"), mod.venv_path("xla")
    assert ipex.parent == tmp_path and ipex.name.startswith("ipex-") and xla.name.startswith("xla-")
    assert ipex.name != xla.name
    monkeypatch.setitem(mod.STACKS["ipex"], "requirements", [*mod.STACKS["ipex"]["requirements"], "extra-pkg"])
    assert mod.venv_path("ipex") != ipex, "a changed requirement set must get a new venv"
    monkeypatch.delenv("HALSERVE_VENV_DIR")
    assert REPO not in mod.venv_path("xla").parents
    assert "torch==2.8.0" in mod.STACKS["ipex"]["requirements"]
    assert "torch==2.9.0" in mod.STACKS["xla"]["requirements"]


def test_list_reports_partial_builds(tmp_path):
    env = {"HALSERVE_VENV_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    path = subprocess.run([sys.executable, str(SCRIPT), "path", "ipex"], capture_output=True, text=True, env=env,
                          check=True).stdout.strip()
    Path(path).mkdir(parents=True)  # a venv folder without the marker: an interrupted build
    out = subprocess.run([sys.executable, str(SCRIPT), "list"], capture_output=True, text=True, env=env,
                         check=True).stdout
    assert f"ipex\tpartial\t{path}" in out
    assert "xla\tabsent" in out
    rc = subprocess.run([sys.executable, str(SCRIPT), "run", "ipex", "--no-build", "--", "python", "-V"],
                        capture_output=True, text=True, env=env)
    assert rc.returncode != 0 and "is not built" in rc.stderr


def test_xpu_dist_backend_by_torch_version():
    from halserve.platforms.xpu import _dist_backend_for

    assert _dist_backend_for("2.8.0+xpu") == "xccl"
    assert _dist_backend_for("2.9.1") == "xccl"
    assert _dist_backend_for("2.5.1+cxx11.abi") == "ccl"


def test_vendor_backends_registered_without_importing_vendors():
    from halserve.plugins import get_plugin_manager

    backends = get_plugin_manager().attention_backends
    assert backends["ipex"].plugin == "xpu" and backends["xla"].plugin == "tpu"
    assert "intel_extension_for_pytorch" not in sys.modules and "torch_xla" not in sys.modules
    if importlib.util.find_spec("intel_extension_for_pytorch") is None:
        assert backends["ipex"].obj.supports(dtype="float32", head_size=64, block_size=16) == (
            "intel_extension_for_pytorch is not installed")
    if importlib.util.find_spec("torch_xla") is None:
        assert backends["xla"].obj.supports(dtype="float32", head_size=64, block_size=16) == "torch_xla is not installed"


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here")
def test_tpu_probe_without_torch_xla_ignores_the_test_switch(monkeypatch):
    from halserve.platforms.tpu import TpuPlatform

    monkeypatch.setenv("HALSERVE_TPU_ALLOW_XLA_CPU", "1")
    result = TpuPlatform.probe()
    assert not result.available and "torch_xla is not installed" in result.reason


def _fake_built_venv(mod, stack: str, pytest_output: str, exit_status: int) -> Path:
    """A venv that looks built and installed, whose python prints a pytest summary."""
    venv = mod.venv_path(stack)
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\necho \"fake $*\"\necho '{pytest_output}'\nexit {exit_status}\n")
    python.chmod(0o755)
    (venv / mod.MARKER).write_text(json.dumps({"stack": stack, "size_bytes": 3 * 2**30}))
    (venv / mod.INSTALL_STAMP).write_text(json.dumps(mod._install_fingerprint()))
    return venv


@pytest.mark.parametrize(("pytest_output", "exit_status", "ok"),
                         [("5 passed, 1 skipped in 2.0s", 0, True), ("1 failed, 4 passed in 2.0s", 1, False),
                          ("no tests ran in 0.1s", 5, False)])
def test_test_command_reuses_runs_and_summarizes(monkeypatch, tmp_path, pytest_output, exit_status, ok):
    """`isolated_env.py test` (CI's isolated step) with a prebuilt stand-in venv: nothing is built."""
    monkeypatch.setenv("HALSERVE_VENV_DIR", str(tmp_path))
    mod = _script()
    venv = _fake_built_venv(mod, "ipex", pytest_output, exit_status)
    env = {**os.environ, "HALSERVE_VENV_DIR": str(tmp_path)}
    env.pop("HALSERVE_SKIP_ISOLATED", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), "test", "ipex"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert f"reusing {venv}" in proc.stdout
    assert "fake -m pytest tests/isolated/ipex -q" in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.strip().startswith("ipex "))
    assert "reused" in row and "3.0 GiB" in row and pytest_output in row, row
    assert (proc.returncode == 0) is ok, proc.stdout + proc.stderr
    assert ("isolated suites: OK" if ok else "isolated suites: FAILED (ipex)") in proc.stdout


def test_test_command_skips_on_request_and_rejects_unknown_stacks(tmp_path):
    env = {**os.environ, "HALSERVE_VENV_DIR": str(tmp_path), "HALSERVE_SKIP_ISOLATED": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "test"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and "skipped (HALSERVE_SKIP_ISOLATED is set)" in proc.stdout
    assert not any(tmp_path.iterdir()), "a skipped step must not create a venv"
    env.pop("HALSERVE_SKIP_ISOLATED")
    proc = subprocess.run([sys.executable, str(SCRIPT), "test", "cuda"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 2 and "unknown stack 'cuda'" in proc.stderr
