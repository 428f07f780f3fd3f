"""`halserve bench serve` (its statistics, and a short run against the test server) and
`halserve bench throughput`."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from server_utils import SERVED_NAME
from halserve.bench.serve import RequestResult, compute_metrics, format_table


def test_statistics():
    results = [
        RequestResult(success=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
        RequestResult(success=True, prompt_len=10, output_tokens=3, ttft=0.3, latency=0.7, itl=[0.2, 0.2]),
        RequestResult(success=False, error="HTTP 400: bad"),
    ]
    m = compute_metrics(results, duration=2.0)
    assert m["completed"] == 2 and m["failed"] == 1 and m["errors"] == ["HTTP 400: bad"]
    assert m["total_input_tokens"] == 20 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(4.0) and m["total_token_throughput"] == pytest.approx(14.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    # TPOT = (latency - ttft) / (tokens - 1): 100 ms and 200 ms
    assert m["mean_tpot_ms"] == pytest.approx(150.0)
    assert m["mean_itl_ms"] == pytest.approx(1000 * (0.4 + 0.4) / 6)
    assert m["p99_itl_ms"] == pytest.approx(200.0)
    table = format_table(m)
    assert "Serving Benchmark Result" in table and "Mean TTFT (ms):" in table and "P99 ITL (ms):" in table


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_against_the_server(server, checkpoint, tmp_path, endpoint):
    result = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "halserve.entrypoints.cli", "bench", "serve", "--base-url", server.url,
         "--model", SERVED_NAME, "--tokenizer", checkpoint, "--endpoint", endpoint, "--num-prompts", "6",
         "--random-input-len", "8", "--random-output-len", "5", "--max-concurrency", "3", "--request-rate", "50",
         "--result-json", str(result)],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Successful requests:" in proc.stdout
    data = json.loads(result.read_text())
    assert data["completed"] == 6 and data["total_output_tokens"] == 30
    if endpoint == "/v1/completions":
        assert data["total_input_tokens"] == 48
    assert data["mean_ttft_ms"] > 0 and data["mean_tpot_ms"] > 0


@pytest.mark.parametrize("flags, expected", [
    (["--num-prompts", "-1"], "--num-prompts must be >= 1"),
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--output-json", "/"], "--output-json /: cannot write a file there"),
    (["--block-size", "3"], "--block-size: block_size must be a power of two"),
    (["--input-len", "100", "--output-len", "100"], "exceed the model's max_model_len 128"),
])
def test_bench_throughput_usage_errors_exit_2(checkpoint, flags, expected):
    """Bad values are a one-line error and exit 2 (not a traceback, nor found after the run)."""
    proc = subprocess.run([sys.executable, "-m", "halserve.entrypoints.cli", "bench", "throughput", "--model",
                           checkpoint, "--platform", "cpu", "--max-model-len", "128", *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_bench_throughput_runs_and_writes_its_figures(checkpoint, tmp_path):
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, "-m", "halserve.entrypoints.cli", "bench", "throughput", "--model",
                           checkpoint, "--platform", "cpu", "--num-prompts", "4", "--input-len", "8", "--output-len",
                           "4", "--output-json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())
    assert figures["num_requests"] == 4 and figures["num_output_tokens"] == 16 and figures["requests_per_s"] > 0
