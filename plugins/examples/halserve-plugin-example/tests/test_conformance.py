"""This plugin against halserve's conformance kit (run after installing the plugin).

Same as ``halserve conformance example`` or ``pytest --halserve-conformance=example``.
"""
from __future__ import annotations

from halserve.plugins import get_plugin_manager
from halserve.plugins.testing import run_conformance


def test_plugin_is_discovered_and_loaded():
    record = get_plugin_manager().record("example")
    assert record is not None, "halserve-plugin-example is not installed in this environment"
    assert record.status == "loaded", record.error


def test_conformance_kit_passes():
    report = run_conformance("example", quick=True)
    assert report.ok, report.table()
    checked = {(r.check, r.subject) for r in report.results if r.status == "passed"}
    # what this plugin contributes was really exercised, not declined
    assert ("kernel", "gemm/example_gemm") in checked
    assert ("attention", "example_attn") in checked
    assert ("platform", "example") in checked
    assert ("e2e", "example") in checked
    # plugin API 2: each hook this plugin implements was checked against halserve's own
    assert ("layer", "ExampleRMSNorm (example/RMSNorm)") in checked  # vs RMSNorm on the same weights
    assert ("variant", "LlamaForCausalLM on example") in checked  # greedy vs the built-in
    ops = {r.case for r in report.results if r.check == "communicator" and r.status == "passed"}
    assert ops >= {"all_reduce", "all_gather dim=0", "all_to_all", "broadcast", "send/recv"}, report.table()
