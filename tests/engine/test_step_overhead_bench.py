"""benchmarks/step_overhead.py runs and accounts for the whole step (a smoke run on W2, 4 prompts)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a step-overhead benchmark, ~20 s (inner loop: -m 'not slow')

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_step_overhead_prints_every_phase(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "step_overhead.py"), "--workloads", "W2",
         "--num-prompts", "4", "--root", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    shares = {}
    for phase in ("schedule", "prepare", "forward", "sample", "update", "detokenize", "other"):
        m = re.search(rf"^\s+{phase}\s+([\d.]+)\s+([\d.]+)%$", out, re.M)
        assert m, f"no {phase} row in:\n{out}"
        shares[phase] = float(m.group(2))
    # the phases partition the step (rounding aside), and the model's forward is a real part of it
    assert abs(sum(shares.values()) - 100.0) < 1.0, shares
    assert shares["forward"] > 0
    m = re.search(r"W2 \(float32\): (\d+) steps", out)
    assert m and int(m.group(1)) >= 64  # 64 output tokens each: at least one step per token
