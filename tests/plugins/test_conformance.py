"""The conformance kit on halserve's own plugins: ``halserve conformance cpu|builtin|cuda|rocm``.

Each run is a fresh subprocess (discovery is once per process, and the CLI decides on
TRITON_INTERPRET before any Triton kernel module is imported). cuda and rocm run their
Triton kernels and backends in the interpreter on the CPU when no GPU is present.
"""
from __future__ import annotations

import json

import pytest
from plugin_test_utils import clean_env, run_python

from halserve.plugins.testing import ConformanceReport


def conformance(*args: str, **env: str):
    result = run_python(["-m", "halserve.entrypoints.cli", "conformance", *args], clean_env(**env), timeout=900)
    return result


def _report(result) -> dict:
    assert result.stdout.strip().startswith("{"), f"no JSON (exit {result.returncode}):\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout)


def _failures(report: dict) -> list[str]:
    return [f"[{r['check']}] {r['subject']} ({r['case']}): {r['detail']}" for r in report["results"] if r["status"] == "failed"]


def test_cpu_passes_with_table_and_exit_0():
    result = conformance("cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "halserve conformance: plugin 'cpu', platform cpu" in result.stdout
    assert "0 failed" in result.stdout and "-> OK" in result.stdout
    for case in ("probe", "device/dist backend", "check_and_update_config idempotent (dtype=auto)",
                 "greedy generation on platform cpu"):
        assert case in result.stdout


def test_builtin_passes_every_op_and_the_torch_backend():
    result = conformance("builtin", "--quick", "--json")
    report = _report(result)
    assert result.returncode == 0, "\n".join(_failures(report))
    assert report["plugin"] == "builtin" and report["ok"] is True
    assert report["summary"]["failed"] == 0
    from halserve.kernels import OPS

    passed = {(r["check"], r["subject"]) for r in report["results"] if r["status"] == "passed"}
    for op in OPS:
        assert ("kernel", f"{op}/torch") in passed, f"no passing case for {op}/torch"
    scenarios = {r["case"].split()[0] for r in report["results"] if r["check"] == "attention" and r["status"] == "passed"}
    assert scenarios >= {"prefill_only", "decode_only", "prefix_hit_chunked", "mixed", "gqa", "mqa", "sliding_window",
                         "fp8_kv", "mla"}  # (mla: the KV-cache kind it claims, tests/plugins/test_spec_kinds.py)
    assert ("e2e", "torch") in passed


@pytest.mark.parametrize("plugin", ["cuda", "rocm"])
def test_triton_plugins_pass_in_the_interpreter(plugin):
    result = conformance(plugin, "--quick", "--json")
    report = _report(result)
    assert result.returncode == 0, "\n".join(_failures(report))
    import torch

    if not torch.cuda.is_available():
        assert report["interpreter"] is True  # the CLI set TRITON_INTERPRET=1 itself
        rows = report["results"]
        ran = [r for r in rows if r["status"] == "passed" and r["check"] in ("kernel", "attention")
               and r["case"] != "declaration"]
        assert len({r["subject"] for r in ran}) >= 9, "the Triton kernels and backend should really run"
        assert any(r["subject"].startswith("triton_paged") and r["status"] == "passed" for r in rows)
        gguf = [r for r in ran if r["subject"] == f"gguf_gemm/triton_{plugin}"]  # the GGUF kernel really ran
        assert gguf and all(r["status"] == "passed" for r in gguf)
        mla = [r for r in rows if r["subject"].startswith("triton_paged") and r["case"].startswith("mla ")]
        assert {r["case"].split()[1] for r in mla if r["status"] == "passed"} >= {"prefill_only", "decode_only",
                                                                                    "prefix_hit_chunked", "mixed"}
        e2e = [r for r in rows if r["check"] == "e2e"]
        assert e2e and all(r["status"] == "declined" and "unavailable here" in r["detail"] for r in e2e)


@pytest.mark.slow
@pytest.mark.parametrize("plugin", ["cuda", "rocm"])
def test_triton_plugins_pass_full_grids(plugin):
    result = conformance(plugin, "--json")
    report = _report(result)
    assert result.returncode == 0, "\n".join(_failures(report))


def test_unknown_plugin_is_a_usage_error():
    result = conformance("no_such_plugin")
    assert result.returncode == 2
    assert "no plugin named 'no_such_plugin'" in result.stderr
    assert "cpu" in result.stderr  # lists what is installed


def test_unknown_platform_is_a_usage_error():
    result = conformance("builtin", "--platform", "nowhere", "--checks", "kernels")
    assert result.returncode == 2
    assert "unknown platform 'nowhere'" in result.stderr


def test_unavailable_platform_without_interpreter_declines_with_reason(monkeypatch):
    import torch

    from halserve.plugins import get_plugin_manager
    from halserve.plugins.testing.target import TargetResolver

    if torch.cuda.is_available():
        pytest.skip("cuda is available here")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    manager = get_plugin_manager()
    kernel = manager.kernels["rms_norm/triton_cuda"].obj
    target = TargetResolver(manager, "cuda").target(kernel)
    assert target.device is None
    assert "platform cuda unavailable here" in target.reason and "TRITON_INTERPRET=1" in target.reason


def test_report_json_and_exit_code():
    report = ConformanceReport("p", "cpu", False)
    report.add("kernel", "gemm/x", "M=1", "passed", "ok")
    report.add("kernel", "gemm/x", "M=7", "declined", "kernel declines: no")
    assert report.exit_code == 0
    report.add("kernel", "gemm/x", "M=33", "failed", "op gemm, kernel x: max |error| 1 > tolerance")
    data = report.to_json()
    assert data["summary"] == {"passed": 1, "failed": 1, "declined": 1, "warned": 0}
    assert data["ok"] is False and report.exit_code == 1
    assert set(data) == {"plugin", "platform", "interpreter", "summary", "ok", "results"}
    assert "failures:" in report.table() and "FAILED" in report.table()


def test_tiny_model_loads_with_transformers(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from halserve.plugins.testing.tiny_model import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "m", head_size=64)
    config = AutoConfig.from_pretrained(path)
    assert config.head_dim == 64 and config.architectures == ["LlamaForCausalLM"]
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("héllo, wörld").input_ids
    assert ids[0] == 1 and tok.decode(ids[1:]) == "héllo, wörld"
