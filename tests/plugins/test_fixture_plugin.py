"""The vendor path, end to end: a third-party wheel with one entry point.

Each scenario runs in a fresh subprocess (discovery is once per process) with the
fixture wheel on PYTHONPATH (see conftest.py): ``halserve plugins --json``, the table,
and ``resolve_platform`` in that one process.
"""
from __future__ import annotations

import pytest
from plugin_test_utils import auto_detected, clean_env, run_halserve, run_scenario

pytestmark = pytest.mark.slow  # builds and installs a plugin wheel, ~1 min (inner loop: -m 'not slow')


def _plugin(report: dict, name: str) -> dict:
    matches = [p for p in report["plugins"] if p["name"] == name]
    assert len(matches) == 1, f"plugin {name!r} listed {len(matches)} times: {report['plugins']}"
    return matches[0]


def _names(rows: list[dict]) -> list[str]:
    return [r["name"] for r in rows]


def test_fixture_is_not_installed_in_the_system_python() -> None:
    report = run_halserve("plugins", "--json", env=clean_env()).json()
    assert "fixture" not in _names(report["plugins"])
    assert "fixture" not in _names(report["platforms"])


def test_discovered_from_its_own_wheel_listed_and_selectable(fixture_env) -> None:
    seen = run_scenario(fixture_env(), resolve=(None, "fixture"))
    report = seen.report
    plugin = _plugin(report, "fixture")
    assert plugin["status"] == "loaded", plugin
    assert plugin["distribution"] == "halserve-fixture-plugin"
    assert plugin["version"] == "0.0.1"
    assert plugin["api"] == ">=1,<2"
    assert plugin["error"] is None

    (platform,) = [p for p in report["platforms"] if p["name"] == "fixture"]
    assert platform["plugin"] == "fixture"
    assert platform["available"] is True
    assert platform["reason"] == "the fixture platform is always available"
    assert platform["device_type"] == "cpu"
    assert platform["dist_backend"] == "gloo"
    assert platform["priority"] == -10

    (backend,) = [b for b in report["attention_backends"] if b["name"] == "fixture_attn"]
    assert backend["plugin"] == "fixture"
    assert backend["platforms"] == ["fixture"]

    # priority -10: auto-detection never picks it (cpu, priority 0, is always available)
    assert report["selected_platform"] == auto_detected(report) != "fixture"
    assert seen.resolve["None"]["ok"][1] == report["selected_platform"]
    # ... and it is selectable by name
    assert seen.resolve["fixture"] == {"ok": ["FixturePlatform", "fixture", "halserve_fixture_plugin"]}
    # the bundled plugins are still there, from halserve's own distribution
    for name in ("cpu", "cuda", "rocm", "xpu", "tpu"):
        assert _plugin(report, name)["distribution"] == "halserve"
    assert _plugin(report, "cpu")["status"] == "loaded"

    assert seen.table_rc == 0
    assert "halserve-fixture-plugin" in seen.table
    assert "fixture_attn" in seen.table
    assert "the fixture platform is always available" in seen.table


def test_selectable_with_halserve_platform(fixture_env) -> None:
    seen = run_scenario(fixture_env(HALSERVE_PLATFORM="fixture"), resolve=(None,))
    report = seen.report
    assert report["selected_platform"] == "fixture"
    assert [p["name"] for p in report["platforms"] if p["selected"]] == ["fixture"]
    assert report["resolved_for"] == "fixture"
    assert report["resolved_attention_backend"] == "fixture_attn"
    assert seen.resolve["None"]["ok"][:2] == ["FixturePlatform", "fixture"]

    flag = run_halserve("plugins", "--json", "--platform", "fixture", env=fixture_env()).json()
    assert flag["selected_platform"] == "fixture"


def test_blocklist_disables_it(fixture_env) -> None:
    seen = run_scenario(fixture_env(HALSERVE_DISABLE_PLUGINS="fixture"), resolve=("fixture",))
    report = seen.report
    assert _plugin(report, "fixture")["status"] == "disabled"
    assert "fixture" not in _names(report["platforms"])
    assert "fixture_attn" not in _names(report["attention_backends"])
    assert "cpu" in _names(report["platforms"])
    error = seen.resolve["fixture"]["error"]
    assert error.startswith("PlatformUnavailableError: unknown platform 'fixture'")
    assert "disabled" in error


def test_allowlist_leaves_it_out(fixture_env) -> None:
    report = run_scenario(fixture_env(HALSERVE_PLUGINS="cpu,builtin")).report
    statuses = {p["name"]: p["status"] for p in report["plugins"]}
    assert statuses["fixture"] == "disabled"
    assert statuses["cuda"] == "disabled"
    assert statuses["cpu"] == "loaded"
    assert _names(report["platforms"]) == ["cpu"]
    assert report["selected_platform"] == "cpu"


def test_unknown_names_are_errors(fixture_env) -> None:
    for var in ("HALSERVE_PLUGINS", "HALSERVE_DISABLE_PLUGINS"):
        seen = run_scenario(fixture_env(**{var: "fixture,nosuchplugin"}), resolve=(None,))
        assert seen.json_rc == 1 and seen.table_rc == 1, (var, seen)
        assert seen.json_stdout == "" and seen.table == ""
        assert f"{var} names unknown plugin(s) nosuchplugin" in seen.stderr
        # the message lists what is installed, third-party plugins included
        installed = seen.stderr.split("installed plugins are: ", 1)[1].splitlines()[0].split(", ")
        assert {"builtin", "cpu", "fixture"} <= set(installed)
        assert seen.resolve["None"]["error"].startswith("PluginSelectionError")


def test_refused_when_api_range_excludes_ours(fixture_env) -> None:
    seen = run_scenario(fixture_env(HALSERVE_FIXTURE_API=">=3"), resolve=("fixture",))
    report = seen.report  # exit 0: a refused plugin is reported, not fatal
    plugin = _plugin(report, "fixture")
    assert plugin["status"] == "refused"
    assert "API >=3," in plugin["error"]  # both versions named: the plugin's and ours
    assert "provides plugin API 2" in plugin["error"]
    assert "fixture" not in _names(report["platforms"])
    assert "refused" in seen.stderr  # logged as a warning
    assert seen.table_rc == 0 and "refused" in seen.table
    assert ">=3" in seen.resolve["fixture"]["error"]  # asking for it quotes why


def test_raise_at_import_is_reported_not_fatal(fixture_env) -> None:
    seen = run_scenario(fixture_env(HALSERVE_FIXTURE_RAISE="1"), resolve=(None, "fixture"))
    report = seen.report
    plugin = _plugin(report, "fixture")
    assert plugin["status"] == "failed"
    assert plugin["error"].startswith("RuntimeError: ")
    assert "HALSERVE_FIXTURE_RAISE=1" in plugin["error"]
    assert "halserve_fixture_plugin" in plugin["traceback"]
    assert "WARNING" in seen.stderr and "'fixture' failed to load" in seen.stderr
    assert _plugin(report, "cpu")["status"] == "loaded"
    # a failed plugin never changes which platform runs
    assert report["selected_platform"] == auto_detected(report)
    assert seen.resolve["None"]["ok"][1] == report["selected_platform"]

    assert seen.table_rc == 0
    assert "plugin 'fixture' failed:" in seen.table
    assert "HALSERVE_FIXTURE_RAISE=1" in seen.table

    error = seen.resolve["fixture"]["error"]
    assert "did not load" in error and "HALSERVE_FIXTURE_RAISE=1" in error


def test_duplicate_name_is_a_conflict_naming_both(fixture_env) -> None:
    seen = run_scenario(fixture_env(HALSERVE_FIXTURE_DUPLICATE="1"), resolve=(None,))
    assert seen.json_rc == 1 and seen.table_rc == 1
    message = "platform 'cpu' is registered by both plugin 'cpu' and plugin 'fixture'"
    assert seen.stderr.count(message) >= 2  # once per command, plus the logged warning
    assert seen.resolve["None"]["error"].startswith("PluginConflictError: " + message)


def test_api_1_plugin_loads_under_api_2_and_passes_the_kit_with_a_deprecation(fixture_env) -> None:
    """The deprecation policy exercised: the fixture wheel declares API 1 (>=1,<2); plugin API 2 loads it
    with a DeprecationWarning listed by `halserve plugins`, and the conformance kit passes, warning."""
    import json

    seen = run_scenario(fixture_env(), resolve=("fixture",))
    plugin = _plugin(seen.report, "fixture")
    assert plugin["status"] == "loaded"
    assert any("built for API 1" in w and "declare api='>=1,<3'" in w for w in plugin["warnings"]), plugin
    assert seen.resolve["fixture"]["ok"][1] == "fixture"
    widened = _plugin(run_scenario(fixture_env(HALSERVE_FIXTURE_API=">=1,<3")).report, "fixture")
    assert widened["status"] == "loaded" and widened["warnings"] == []

    result = run_halserve("conformance", "fixture", "--checks", "platforms,layers", "--json", env=fixture_env())
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["ok"], result.stdout + result.stderr
    (row,) = [r for r in report["results"] if r["case"] == "deprecations"]
    assert row["status"] == "warned" and "built for API 1" in row["detail"]
