"""scripts/vendor_example_check.sh: the example plugin's wheel in a fresh venv is listed by
``halserve plugins`` (with its layer override, model variant and communicator), passes ``halserve
conformance`` (the API 2 checks included), serves a completion on its platform through its own
RMSNorm (the server's log shows it),
and a renamed copy (the new-vendor path) passes the kit too. Nothing is installed into the
system Python (the script checks that as well)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from plugin_test_utils import clean_env

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # builds and installs the example plugin, ~3 min (inner loop: -m 'not slow')

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vendor_example_check.sh"


def test_vendor_example_check_script_passes():
    proc = subprocess.run(["bash", str(SCRIPT), "--quick"], env=clean_env(), capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-4000:]}"
    out = proc.stdout
    assert "plugin example: loaded halserve-plugin-example 0.2.0" in out
    assert "plugin example (API 2): halserve_plugin_example.layers.ExampleRMSNorm for RMSNorm" in out
    assert "completion from platform example:" in out
    assert "override used: " in out and "ExampleRMSNorm: first forward on the example device" in out
    assert "vendor_example_check: OK" in out
    import importlib.util

    assert importlib.util.find_spec("halserve_plugin_example") is None, "the example leaked into this Python"
