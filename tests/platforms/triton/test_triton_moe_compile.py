"""The fused-MoE grouped GEMM and GELU(tanh)-and-mul compile for every GPU target, on the matrix units.

``test_triton_gpu_compile.py`` already checks that every case (these included) compiles, fits
and does not spill; this adds what is particular to the MoE GEMM: its dots must run on
tensor cores / MFMA in the activation's type at every tile bucket, fp32 stays exact (no tf32),
and its shared memory fits each part with the ``num_stages`` fitted to it. In a subprocess
run without ``TRITON_INTERPRET`` (this directory's conftest sets it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from halserve.platforms.triton_kernels.compile_check import TARGETS

MAX_SPILL_BYTES = 16
CASE_PREFIXES = ("fused_moe/", "elementwise/gelu_tanh")

# every target in one process (imports once; ~4 s with a warm Triton cache, ~1 min cold)
_CHECK_ALL = f"""
import dataclasses, json
from halserve.platforms.triton_kernels.compile_cases import cases
from halserve.platforms.triton_kernels.compile_check import TARGETS, check

out = {{}}
for name, target in TARGETS.items():
    builds, errors = [], {{}}
    for only in {CASE_PREFIXES!r}:
        b, e = check(name, only)
        builds += b
        errors.update(e)
    out[name] = {{"target": dataclasses.asdict(target), "errors": errors,
                 "cases": [c for c in cases(target) if c.startswith({CASE_PREFIXES!r})],
                 "builds": [dataclasses.asdict(b) for b in builds]}}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _CHECK_ALL], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("target", list(TARGETS))
def test_moe_and_gelu_compile_and_fit(reports, target):
    report = reports[target]
    assert report["errors"] == {}, report["errors"]
    assert {c for c in report["cases"] if c.startswith("fused_moe/")} >= {
        "fused_moe/mixtral-bf16-t1", "fused_moe/mixtral-bf16-t4096", "fused_moe/mixtral-float32-t64"}
    assert "elementwise/gelu_tanh_and_mul" in report["cases"]
    assert {b["case"] for b in report["builds"]} == set(report["cases"]), "a case compiled nothing"
    for b in report["builds"]:
        where = f"{b['case']} {b['kernel']} on {target}"
        assert b["shared_bytes"] <= report["target"]["max_shared_bytes"], where
        assert b["spill_bytes"] <= MAX_SPILL_BYTES, f"{where} spills {b['spill_bytes']} bytes"
        assert b["programs_per_sm"] >= 1 and b["grid"] is not None, where


@pytest.mark.parametrize("target", list(TARGETS))
def test_moe_dots_run_on_matrix_units_in_the_activation_type(reports, target):
    backend = TARGETS[target].backend
    moe = [b for b in reports[target]["builds"] if b["kernel"] == "moe_gemm_kernel"]
    assert moe
    for b in moe:
        case, ops = b["case"], set(b["matrix_operands"])
        if "float32" in case:  # ieee fp32: FMA units on NVIDIA, fp32 MFMA on AMD, never tf32
            assert ops == (set() if backend == "cuda" else {"f32"}), (case, ops)
            continue
        assert b["matrix_instructions"] > 0, f"{case} on {target}: no tensor-core/MFMA instruction"
        assert ops == ({"f16"} if "float16" in case else {"bf16"}), (case, ops)
