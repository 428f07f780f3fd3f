"""Helpers for the plugin tests: load a plugin module into a new manager; run halserve / Python in a
fresh subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from dataclasses import dataclass

from halserve.plugins import PluginManager, PluginRecord


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> dict:
        assert self.returncode == 0, f"exit {self.returncode}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"
        return json.loads(self.stdout)


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without any HALSERVE_* setting of the outer process, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HALSERVE_")}
    env.update(extra)
    return env


def load_plugin(plugin: types.ModuleType, name: str = "acme") -> tuple[PluginManager, PluginRecord]:
    """A new PluginManager with ``plugin`` (a module the test built) loaded under ``name``, and the
    plugin's record: status "loaded", or "failed" with its error."""
    mgr = PluginManager()
    record = PluginRecord(name=name, target=plugin.__name__, distribution=None)
    mgr.load_plugin(name, plugin, record)
    return mgr, record


def run_python(code_or_args: list[str], env: dict[str, str], timeout: int = 120) -> Result:
    proc = subprocess.run(
        [sys.executable, *code_or_args], env=env, capture_output=True, text=True, timeout=timeout
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def run_halserve(*args: str, env: dict[str, str]) -> Result:
    return run_python(["-m", "halserve.entrypoints.cli", *args], env)


# Runs, in ONE fresh process: `halserve plugins --json`, `halserve plugins`, then
# resolve_platform(name) for each name given (None = HALSERVE_PLATFORM / auto-detect).
_SCENARIO = r"""
import contextlib, io, json, sys
from halserve.entrypoints.cli import main
report = {}
for key, argv in (("json", ["plugins", "--json"]), ("table", ["plugins"])):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    report[key] = {"rc": rc, "stdout": buf.getvalue()}
from halserve.platforms import resolve_platform
report["resolve"] = {}
for name in json.loads(sys.argv[1]):
    try:
        p = resolve_platform(name)
        report["resolve"][str(name)] = {"ok": [type(p).__name__, p.name, type(p).__module__]}
    except Exception as exc:
        report["resolve"][str(name)] = {"error": type(exc).__name__ + ": " + str(exc)}
print("@@SCENARIO@@" + json.dumps(report))
"""


@dataclass
class Scenario:
    """What one process saw: the two CLI outputs, resolve results and the logged stderr."""

    json_rc: int
    json_stdout: str
    table_rc: int
    table: str
    resolve: dict  # name ("None" for auto) -> {"ok": [class, name, module]} | {"error": "Type: msg"}
    stderr: str

    @property
    def report(self) -> dict:
        assert self.json_rc == 0, f"halserve plugins --json exited {self.json_rc}:\n{self.stderr}"
        return json.loads(self.json_stdout)


def run_scenario(env: dict[str, str], resolve: tuple[str | None, ...] = ()) -> Scenario:
    result = run_python(["-c", _SCENARIO, json.dumps(list(resolve))], env)
    marker = "@@SCENARIO@@"
    assert result.returncode == 0 and marker in result.stdout, (
        f"scenario process failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    )
    data = json.loads(result.stdout.split(marker, 1)[1])
    return Scenario(
        data["json"]["rc"], data["json"]["stdout"], data["table"]["rc"], data["table"]["stdout"],
        data["resolve"], result.stderr,
    )


def auto_detected(report: dict) -> str:
    """What auto-detection must pick: the first available platform, highest priority first
    (cpu on a CPU-only machine; cuda on a machine with an NVIDIA GPU)."""
    return next(p["name"] for p in report["platforms"] if p["available"])
