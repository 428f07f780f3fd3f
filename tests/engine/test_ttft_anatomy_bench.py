"""benchmarks/ttft_anatomy.py: its legs from a hand-made trace, and a smoke run against a real server."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from ttft_anatomy import legs  # noqa: E402


def _write(path, rows):
    path.write_text("".join(" ".join(map(str, row)) + "\n" for row in rows))


def test_legs_of_a_hand_made_trace(tmp_path):
    # two requests (seconds): sent at 1.000 and 1.001; prepared at 1.010 / 1.012; submitted at 1.015 / 1.016;
    # added to the core at 1.030 / 1.031; a decode step 1.020-1.029, then request 1's prompt step 1.0305-1.060 (request 2, added after it had
    # started, in the next one, 1.061-1.080); outputs processed 1.062-1.063 and 1.081-1.083; first tokens read
    # by the client at 1.065 and 1.085. A request sent after `end` is left out.
    _write(tmp_path / "trace_1.txt", [("C", 1.000, 1.065), ("C", 1.001, 1.085), ("C", 9.0, 9.1)])
    _write(tmp_path / "trace_2.txt", [("P", 1.010), ("P", 1.012), ("W", 1.015), ("W", 1.016), ("W", 9.015), ("O", 1.062, 1.063, 2), ("O", 1.081, 1.083, 2),
                                      ("P", 9.01)])
    _write(tmp_path / "trace_3.txt", [("S", 1.020, 1.029, 64, 64, 0), ("A", 1.030), ("A", 1.031),
                                      ("S", 1.0305, 1.060, 100, 64, 2), ("S", 1.061, 1.080, 70, 64, 1),
                                      ("A", 9.02), ("S", 9.03, 9.04, 1, 1, 1)])
    per_leg, figures = legs(str(tmp_path), 2, end=5.0)
    ms = {k: [round(v, 3) for v in values] for k, values in per_leg.items()}
    assert ms["client TTFT"] == [65.0, 84.0]
    assert ms["client send -> API prepare"] == [10.0, 11.0]
    assert ms["API prepare -> submitted"] == [5.0, 4.0]
    assert ms["submitted -> engine add"] == [15.0, 15.0]
    # request 2 was added at 1.031, after the step at 1.0305 had started: its first step is the next one
    assert ms["engine add -> first step start"] == [0.5, 30.0]
    assert ms["first step start -> first token's step end"] == [29.5, 19.0]
    assert ms["step end -> API outputs done"] == [3.0, 3.0]
    assert ms["API outputs done -> client"] == [2.0, 2.0]
    assert figures["steps"] == 3 and figures["steps with prompts"] == 2  # (after the first send, before end)
    assert figures["ms a step with prompts (median)"] == pytest.approx((29.5 + 19.0) / 2)
    assert figures["ms a decode-only step (median)"] == pytest.approx(9.0)


def test_an_incomplete_trace_is_an_error(tmp_path):
    _write(tmp_path / "trace_1.txt", [("C", 1.0, 1.1)])
    with pytest.raises(SystemExit, match="incomplete trace"):
        legs(str(tmp_path), 2, end=5.0)


@pytest.mark.slow  # a server start and two loads, ~25 s
def test_ttft_anatomy_runs_against_a_server(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "ttft_anatomy.py"), "--workload", "W2", "--models-dir",
         str(tmp_path), "--num-prompts", "8", "--max-concurrency", "4"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "(8 requests traced)" in proc.stdout, proc.stdout
    row = re.search(r"^\| client TTFT \| ([\d.]+) \|", proc.stdout, re.M)
    assert row and float(row.group(1)) > 0, proc.stdout
    for leg in ("client send -> API prepare", "first step start -> first token's step end"):
        assert re.search(rf"^\| {re.escape(leg)} \| [\d.]+ \|", proc.stdout, re.M), proc.stdout
