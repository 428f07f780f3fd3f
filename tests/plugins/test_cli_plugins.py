"""`halserve plugins`: the report's shape, kernel/attention resolution, exit codes.

In-process tests install a hand-built PluginManager as the process's manager, so they
do not depend on which bundled plugins load right now; one test runs the real command.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from plugin_test_utils import auto_detected, clean_env, run_halserve

from halserve.attention_backends.base import AttentionBackend
from halserve.entrypoints import cli_plugins
from halserve.entrypoints.cli import main
from halserve.kernels import OPS, Kernel
from halserve.platforms.base import Platform, ProbeResult
from halserve.platforms.cpu import CpuPlatform
from halserve.plugins import PluginManager, PluginManifest, PluginRecord
from halserve.plugins import manager as manager_module

REQUIRED_KEYS = {
    "api_version", "plugins", "platforms", "attention_backends", "kernels", "quant_methods",
    "kv_connectors", "executors", "models", "selected_platform", "resolved_kernels",
    "resolved_attention_backend",
}


class GpuLike(Platform):
    name = "gpulike"
    device_type = "cuda"
    dist_backend = "nccl"
    priority = 50
    default_dtype = "bfloat16"
    supported_dtypes = ("bfloat16", "float32")
    preferred_attention_backends = ("fast_attn", "ref_attn")

    @classmethod
    def _probe(cls) -> ProbeResult:
        return ProbeResult(False, "no gpulike device here")


class RefAttn(AttentionBackend):
    name = "ref_attn"
    platforms = ("*",)


class FastAttn(AttentionBackend):
    name = "fast_attn"
    platforms = ("gpulike",)
    dtypes = ("float16",)  # rejects gpulike's default bfloat16 -> falls back to ref_attn


class RefGemm(Kernel):
    op, name, platforms = "gemm", "ref", ("*",)


class FastGemm(Kernel):
    op, name, platforms, priority = "gemm", "fast", ("cpu",), 10


class Fp16OnlyRmsNorm(Kernel):
    op, name, platforms, priority, dtypes = "rms_norm", "half", ("cpu",), 5, ("float16",)


class BrokenSilu(Kernel):
    op, name, platforms = "silu_and_mul", "broken", ("cpu",)

    @classmethod
    def _supports(cls, **problem):
        raise RuntimeError("boom")


class Quant:
    name = "myquant"
    platforms = ("cpu",)

    @classmethod
    def describe(cls):
        return {"bits": 4}


@pytest.fixture
def fake_manager(monkeypatch: pytest.MonkeyPatch) -> PluginManager:
    """A manager with known contents, installed as this process's plugin manager."""
    monkeypatch.delenv("HALSERVE_PLATFORM", raising=False)
    m = PluginManager()
    manifest = PluginManifest(name="acme", version="1.2.3", api=">=1,<2", description="test")
    m.records = [
        PluginRecord("acme", "acme.plugin", "halserve-acme", status="loaded", manifest=manifest),
        PluginRecord("broken", "broken.plugin", "halserve-broken", status="failed",
                     error="ImportError: no libacme", traceback='  File "broken.py", line 1\nImportError: no libacme'),
        PluginRecord("off", "off.plugin", None, status="disabled"),
    ]
    m.platforms.add("cpu", "acme", CpuPlatform)
    m.platforms.add("gpulike", "acme", GpuLike)
    m.attention_backends.add("ref_attn", "acme", RefAttn)
    m.attention_backends.add("fast_attn", "acme", FastAttn)
    for k in (RefGemm, FastGemm, Fp16OnlyRmsNorm, BrokenSilu):
        m.kernels.add(f"{k.op}/{k.name}", "acme", k)
    m.quant_methods.add("myquant", "acme", Quant)
    m.models.add("AcmeForCausalLM", "acme", "acme.models:AcmeForCausalLM")
    monkeypatch.setattr(manager_module, "_manager", m)
    return m


def test_json_shape(fake_manager, capsys) -> None:
    assert main(["plugins", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert REQUIRED_KEYS <= set(report)
    assert report["api_version"] == 2

    plugins = {p["name"]: p for p in report["plugins"]}
    assert {"name", "version", "distribution", "api", "status", "error"} <= set(plugins["acme"])
    assert (plugins["acme"]["version"], plugins["acme"]["api"], plugins["acme"]["distribution"]) == (
        "1.2.3", ">=1,<2", "halserve-acme")
    assert plugins["broken"]["status"] == "failed"
    assert plugins["broken"]["error"] == "ImportError: no libacme"
    assert plugins["off"]["status"] == "disabled"

    platforms = {p["name"]: p for p in report["platforms"]}
    assert [p["name"] for p in report["platforms"]] == ["gpulike", "cpu"]  # priority order
    assert platforms["cpu"]["available"] is True and platforms["cpu"]["selected"] is True
    assert platforms["gpulike"]["available"] is False
    assert platforms["gpulike"]["reason"] == "no gpulike device here"
    assert platforms["gpulike"]["plugin"] == "acme"
    assert platforms["gpulike"]["dist_backend"] == "nccl"  # from describe()
    assert platforms["gpulike"]["default_dtype"] == "bfloat16"
    assert platforms["gpulike"]["device_type"] == "cuda"

    kernels = {(k["op"], k["name"]): k for k in report["kernels"]}
    assert kernels[("gemm", "fast")]["platforms"] == ["cpu"]
    assert kernels[("gemm", "fast")]["priority"] == 10
    assert kernels[("gemm", "fast")]["plugin"] == "acme"
    assert kernels[("rms_norm", "half")]["dtypes"] == ["float16"]

    (quant,) = report["quant_methods"]
    assert quant == {"platforms": ["cpu"], "bits": 4, "name": "myquant", "plugin": "acme"}
    assert report["models"] == [{"name": "AcmeForCausalLM", "plugin": "acme", "target": "acme.models:AcmeForCausalLM"}]
    assert report["executors"] == [] and report["kv_connectors"] == []

    assert report["selected_platform"] == "cpu"
    assert report["selected_platform_error"] is None


def test_resolution_on_the_selected_platform(fake_manager) -> None:
    report = cli_plugins.collect(fake_manager)
    assert report["resolved_for"] == "cpu"
    assert set(report["resolved_kernels"]) == set(OPS)
    resolved = report["resolved_kernels"]
    assert resolved["gemm"] == "fast"  # highest priority that supports float32
    assert resolved["rms_norm"] is None  # the only kernel wants float16
    assert "dtype float32 not supported" in report["resolution_errors"]["rms_norm"]
    assert resolved["silu_and_mul"] is None
    assert "supports() raised RuntimeError: boom" in report["resolution_errors"]["silu_and_mul"]
    assert resolved["awq_gemm"] is None
    assert "no kernel for awq_gemm is registered for platform cpu" in report["resolution_errors"]["awq_gemm"]
    # CpuPlatform prefers ("torch",), which this manager does not register
    assert report["resolved_attention_backend"] is None
    assert report["attention_backend_error"] == "cpu_native: not registered; torch: not registered"


def test_explicit_unavailable_platform_still_shows_its_resolution(fake_manager) -> None:
    report = cli_plugins.collect(fake_manager, "gpulike")
    assert report["selected_platform"] is None
    assert "gpulike" in report["selected_platform_error"]
    assert "no gpulike device here" in report["selected_platform_error"]
    assert report["resolved_for"] == "gpulike"
    assert report["resolved_kernels"]["gemm"] == "ref"  # "fast" runs on cpu only
    # fast_attn rejects bfloat16, so the next preference wins
    assert report["resolved_attention_backend"] == "ref_attn"
    assert report["attention_problem"]["dtype"] == "bfloat16"  # gpulike's default dtype
    (skipped,) = report["attention_backend_skipped"]
    assert skipped.startswith("fast_attn: dtype bfloat16 not supported")

    unknown = cli_plugins.collect(fake_manager, "nosuch")
    assert unknown["selected_platform"] is None and unknown["resolved_for"] is None
    assert "unknown platform 'nosuch'" in unknown["selected_platform_error"]
    assert set(unknown["resolved_kernels"].values()) == {None}
    assert unknown["resolved_attention_backend"] is None


def test_table(fake_manager, capsys) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    rows = [line.split()[:3] for line in lines if line.split()[:3] in (["*", "cpu", "yes"], ["gpulike", "no", "50"])]
    assert rows == [["gpulike", "no", "50"], ["*", "cpu", "yes"]]  # the selected platform is marked
    assert any("gpulike" in line and "no gpulike device here" in line for line in lines)
    assert "plugin 'broken' failed:" in out and "ImportError: no libacme" in out
    assert "gemm -> fast" in out
    assert "rms_norm -> none (" in out
    assert "AcmeForCausalLM" in out and "myquant" in out
    assert "on cpu (dtype=float32, head_size=128, block_size=16, num_heads=32, num_kv_heads=8): none (cpu_native: not registered; torch: not registered)" in out


def test_table_with_platform_flag(fake_manager, capsys) -> None:
    assert main(["plugins", "--platform", "gpulike"]) == 0
    out = capsys.readouterr().out
    assert "no platform selected" in out
    assert "Kernels (resolved on gpulike)" in out
    assert "gemm -> ref" in out
    assert "): ref_attn" in out and "passed over fast_attn: dtype bfloat16 not supported" in out


def test_conflict_exits_1(fake_manager, capsys) -> None:
    fake_manager.conflicts.append("platform 'cpu' is registered by both plugin 'cpu' and plugin 'acme'")
    assert main(["plugins", "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "registered by both plugin 'cpu' and plugin 'acme'" in captured.err


def test_unknown_allowlist_name_exits_1(monkeypatch, capsys) -> None:
    monkeypatch.setattr(manager_module, "_manager", None)  # fresh discovery under the bad env
    monkeypatch.setenv("HALSERVE_DISABLE_PLUGINS", "nosuchplugin")
    assert main(["plugins"]) == 1
    err = capsys.readouterr().err
    assert "HALSERVE_DISABLE_PLUGINS names unknown plugin(s) nosuchplugin" in err
    assert "installed plugins are:" in err and "cpu" in err


def test_real_command_in_a_subprocess() -> None:
    """The installed console script, with whatever the bundled plugins are today."""
    exe = shutil.which("halserve")
    cmd = [exe] if exe else [sys.executable, "-m", "halserve.entrypoints.cli"]
    proc = subprocess.run([*cmd, "plugins", "--json"], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert REQUIRED_KEYS <= set(report)
    names = [p["name"] for p in report["platforms"]]
    assert "cpu" in names
    assert report["selected_platform"] == auto_detected(report)
    for plugin in report["plugins"]:
        assert plugin["status"] in ("loaded", "failed", "refused", "disabled")
        if plugin["status"] != "loaded":
            assert plugin["error"] or plugin["status"] == "disabled"
    table = run_halserve("plugins", env=clean_env())
    assert table.returncode == 0, table.stderr
    assert "Platforms (* = selected)" in table.stdout


def test_deprecated_hook_warns_and_is_listed(monkeypatch):
    """A plugin implementing a deprecated hook still loads, with the warning on its record."""
    import types

    from halserve.plugins import PluginManifest, hookimpl
    from halserve.plugins import manager as manager_mod
    from halserve.plugins.hookspecs import hookspec
    from halserve.plugins.manager import PluginManager, PluginRecord

    monkeypatch.setitem(manager_mod.DEPRECATED_HOOKS, "halserve_old_thing", (1, "implement halserve_platforms instead"))
    plugin = types.SimpleNamespace(
        halserve_manifest=hookimpl(lambda: PluginManifest(name="old", version="1", api=">=1,<2")),
        halserve_old_thing=lambda: None,
    )

    class OldSpecs:  # a deprecated hook keeps its hookspec while it is supported
        @hookspec
        def halserve_old_thing(self) -> None:
            """Deprecated."""

    mgr = PluginManager()
    mgr.pm.add_hookspecs(OldSpecs)
    record = PluginRecord(name="old", target="old", distribution=None)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr.load_plugin("old", plugin, record)
    assert record.status == "loaded"
    assert any("deprecated since plugin API 1" in str(w.message) for w in caught)
    assert "warnings" in record.to_json()
