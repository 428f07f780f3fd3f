"""The kernel benchmarks import and run (``--tiny``: CPU interpreter here, small on a GPU)."""
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # runs the kernel benchmarks, ~90 s (inner loop: -m 'not slow')

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.parametrize("script,flags,expect", [
    ("bench_paged_attention.py", [], "GB/s"),
    ("bench_paged_attention.py", ["--decode-only"], "reference: torch SDPA decode"),  # same-device references
    ("bench_paged_attention.py", ["--sweep"], "splits=8 stages=5"),  # the tuning sweep run_gpu_checks.sh uses
    ("bench_paged_attention.py", ["--grid"], "st5/s8"),  # batch x context table behind the split policy
    ("bench_gemm.py", [], "TFLOP/s"),
])
def test_benchmark_tiny_runs(script, flags, expect):
    path = os.path.join(ROOT, "benchmarks", "kernels", script)
    result = subprocess.run([sys.executable, path, "--tiny", *flags], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert expect in result.stdout
