"""The serving stack under a load: halserve's API server with and without uvloop/httptools, and what the load
generator itself costs (BENCHMARKS.md, "A lean benchmark client; uvloop and httptools").

    python benchmarks/serving_stack.py [--workload W2] [--num-prompts 1024] [--max-concurrency 64] [--rounds 3]

Each round starts `halserve serve` twice, with uvicorn on uvloop and httptools ("with") and on asyncio and h11
("without": both modules hidden from the server process by stubs that fail to import), and drives each with
`halserve bench serve`'s load in this process, timing its CPU (`time.process_time`): client CPU per streamed token,
output tok/s, p50 / p99 TTFT and p50 TPOT. Run under `flock /tmp/cpu.lock` on a shared machine.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare_serving import free_port, stop_server, wait_healthy  # noqa: E402
from workloads import WORKLOADS, ensure_checkpoint  # noqa: E402


def serve(path: str, port: int, stack: str, log: str):
    import subprocess

    env = dict(os.environ)
    if stack == "without":
        stubs = tempfile.mkdtemp(prefix="no_uvloop_")
        for name in ("uvloop", "httptools"):
            with open(os.path.join(stubs, f"{name}.py"), "w") as f:
                f.write('raise ImportError("hidden by benchmarks/serving_stack.py")\n')
        env["PYTHONPATH"] = stubs + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "halserve.entrypoints.cli", "serve", path, "--platform", "cpu", "--dtype", "float32",
           "--no-enable-prefix-caching", "--host", "127.0.0.1", "--served-model-name", path, "--port", str(port)]
    return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=tempfile.gettempdir())


def load(base: str, path: str, w: dict, num_prompts: int, concurrency: int) -> dict:
    from halserve.bench import serve as bench

    parser = argparse.ArgumentParser()
    bench.add_args(parser)
    args = parser.parse_args(["--base-url", base, "--model", path, "--num-prompts", str(num_prompts),
                              "--random-input-len", str(w["input_len"]), "--random-output-len", str(w["output_len"]),
                              "--max-concurrency", str(concurrency)])
    bench.resolve_image_args(args)
    prompts = bench.sample_prompts(bench.load_tokenizer(path), num_prompts, w["input_len"], args.seed, False)
    cpu = time.process_time()
    m = asyncio.run(bench.benchmark(args, prompts, [[] for _ in prompts], []))
    m["client_us_per_token"] = (time.process_time() - cpu) * 1e6 / max(1, m["total_output_tokens"])
    return m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="W2", choices=sorted(WORKLOADS))
    ap.add_argument("--models-dir", default=os.path.join("bench_out", "models"))
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    path = os.path.abspath(ensure_checkpoint(args.workload, args.models_dir))
    w = WORKLOADS[args.workload]
    print("| round | server stack | output tok/s | p50 TTFT ms | p99 TTFT ms | p50 TPOT ms | client CPU us/token |")
    print("|---|---|---|---|---|---|---|")
    for rnd in range(1, args.rounds + 1):
        for stack in ("without", "with"):
            port = free_port()
            proc = serve(path, port, stack, os.path.join(tempfile.gettempdir(), f"serving_stack_{stack}.log"))
            try:
                base = f"http://127.0.0.1:{port}"
                wait_healthy(base, proc, 300)
                m = load(base, path, w, args.num_prompts, args.max_concurrency)
            finally:
                stop_server(proc)
            print(f"| {rnd} | {stack} uvloop/httptools | {m['output_throughput']:.1f} | {m['median_ttft_ms']:.1f} | "
                  f"{m['p99_ttft_ms']:.1f} | {m['median_tpot_ms']:.2f} | {m['client_us_per_token']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
