"""`import halserve`, plugin discovery and `halserve plugins` import no vendor library.

Each check runs in a fresh interpreter and looks at top-level module names exactly:
torch itself may import submodules such as ``torch._inductor.runtime.triton_helpers``,
which is fine; ``triton`` in ``sys.modules`` is not.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

FORBIDDEN = (
    "triton",
    "flash_attn",
    "intel_extension_for_pytorch",
    "torch_xla",
    "ray",
    "fastapi",
    "uvicorn",
    "prometheus_client",
    "starlette",
)

STEPS = {
    "import halserve": "import halserve",
    "discovery": "import halserve.plugins as p; m = p.get_plugin_manager(); assert m.records",
    "halserve plugins --json": (
        "import contextlib, io\n"
        "from halserve.entrypoints.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    rc = main(['plugins', '--json'])\n"
        "assert rc == 0, rc\n"
        "assert out.getvalue().lstrip().startswith('{')\n"
    ),
}


def _loaded_after(code: str) -> list[str]:
    probe = code + f"\nimport json, sys\nprint('@@' + json.dumps([m for m in {list(FORBIDDEN)!r} if m in sys.modules]))\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HALSERVE_")}
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"step failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.rsplit("@@", 1)[1])


@pytest.mark.parametrize("step", list(STEPS))
def test_no_vendor_or_server_library_is_imported(step: str) -> None:
    assert _loaded_after(STEPS[step]) == [], f"after {step!r} these were imported"


def test_import_halserve_does_not_import_torch() -> None:
    # Stronger than the list above: a bare `import halserve` (e.g. for `halserve --version`)
    # does not even pay for torch.
    assert "torch" not in json.loads(
        subprocess.run(
            [sys.executable, "-c", "import halserve, sys, json; print(json.dumps(sorted(sys.modules)))"],
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout
    )
