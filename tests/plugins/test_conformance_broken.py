"""A plugin with planted bugs (tests/plugins/broken_plugin, its own wheel) fails the kit,
with messages that name the op or backend and the failing case; the pytest plugin works.

The wheel goes into a temporary ``--target`` folder put on PYTHONPATH of subprocesses only.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_test_utils import clean_env, run_python

pytestmark = pytest.mark.slow  # the conformance kit in subprocesses, ~2 min (inner loop: -m 'not slow')

BROKEN_SRC = Path(__file__).parent / "broken_plugin"


@pytest.fixture(scope="module")
def broken_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    work = tmp_path_factory.mktemp("broken_plugin")
    src = work / "src"
    shutil.copytree(BROKEN_SRC, src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
         str(work / "wheels"), str(src)], capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, f"building the broken plugin wheel failed:\n{build.stdout}\n{build.stderr}"
    (wheel,) = (work / "wheels").glob("halserve_broken_plugin-*.whl")
    site = work / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert install.returncode == 0, f"installing the broken plugin wheel failed:\n{install.stdout}\n{install.stderr}"
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _failed(report: dict, check: str, subject: str) -> list[dict]:
    return [r for r in report["results"] if r["status"] == "failed" and r["check"] == check and r["subject"] == subject]


def test_kit_fails_the_broken_plugin_and_points_at_each_bug(broken_env):
    result = run_python(["-m", "halserve.entrypoints.cli", "conformance", "broken", "--quick", "--json"], broken_env,
                        timeout=900)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["summary"]["failed"] > 0

    gemm = _failed(report, "kernel", "gemm/broken_gemm")
    assert gemm, "the 1.01x GEMM must fail"
    assert all("op gemm, kernel broken_gemm, case M=" in r["detail"] and "tolerance" in r["detail"] for r in gemm)
    assert any("float32" in r["case"] and "1.00e-02 of max |ref|" in r["detail"] for r in gemm)

    fp8 = _failed(report, "kernel", "fp8_scaled_gemm/broken_fp8")
    assert fp8 and all("op fp8_scaled_gemm, kernel broken_fp8" in r["detail"] for r in fp8)

    attn = _failed(report, "attention", "broken_attn")
    cases = {r["case"].split()[0] for r in attn}
    assert {"prefill_only", "mixed", "prefix_hit_chunked"} <= cases
    prefill = next(r for r in attn if r["case"].startswith("prefill_only"))
    assert "attention backend broken_attn, case prefill_only" in prefill["detail"]
    assert "worst at request" in prefill["detail"] and "prefill" in prefill["detail"]

    assert _failed(report, "e2e", "broken"), "greedy generation must differ from the CPU reference"
    # what is right in the plugin still passes
    passed = {(r["check"], r["case"]) for r in report["results"] if r["status"] == "passed" and r["subject"] == "broken"}
    assert ("platform", "probe") in passed and ("platform", "device/dist backend") in passed


def test_table_lists_failures(broken_env):
    result = run_python(["-m", "halserve.entrypoints.cli", "conformance", "broken", "--quick", "--checks", "kernels"],
                        broken_env, timeout=600)
    assert result.returncode == 1
    assert "failures:" in result.stdout and "-> FAILED" in result.stdout
    assert "[kernel] gemm/broken_gemm (M=1 N=48 K=64 float32)" in result.stdout


def _pytest(tmp_path: Path, env: dict[str, str], *args: str):
    env = dict(env)
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )


def test_pytest_plugin_passes_cpu(tmp_path):
    proc = _pytest(tmp_path, clean_env(), "--halserve-conformance=cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " passed" in proc.stdout and "failed" not in proc.stdout
    assert "declined: the plugin does not implement halserve_update_config" in proc.stdout  # -rs shows skips


def test_pytest_plugin_fails_broken(tmp_path, broken_env):
    proc = _pytest(tmp_path, broken_env, "--halserve-conformance=broken", "--halserve-conformance-quick")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "op gemm, kernel broken_gemm" in proc.stdout
    assert "attention backend broken_attn" in proc.stdout
