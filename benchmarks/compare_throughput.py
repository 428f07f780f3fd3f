"""Side-by-side throughput: halserve vs vLLM's CPU build vs transformers, in one run.

    python benchmarks/compare_throughput.py [--workloads W1 W2] [--vllm-python PATH] [--skip-hf]

Each engine runs in its own fresh process, one after another, on the same checkpoint and
the same random prompts, ``--repeats`` times (halserve and vLLM; the median run is
reported, all runs are printed). vLLM runs from its own venv (it pins its own torch build); see
BENCHMARKS.md for how that venv is made. Prints output tok/s and the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from workloads import WORKLOADS, ensure_checkpoint  # noqa: E402


def _median_run(cmd: list[str], repeats: int, env: dict | None = None) -> dict | None:
    """Run ``cmd`` ``repeats`` times (fresh processes); the run with the median output tok/s."""
    runs = [r for r in (_run(cmd, env) for _ in range(repeats)) if r]
    if not runs:
        return None
    runs.sort(key=lambda r: r["output_tokens_per_s"])
    best = dict(runs[len(runs) // 2])
    best["all_output_tokens_per_s"] = [round(r["output_tokens_per_s"], 1) for r in runs]
    return best


def _run(cmd: list[str], env: dict | None = None) -> dict | None:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [c.replace("{json}", out) for c in cmd]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, text=True, capture_output=True)
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
    print(tail, flush=True)
    if proc.returncode != 0:
        print(f"  failed with exit code {proc.returncode}", flush=True)
        return None
    with open(out) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--models-dir", default=os.path.join("bench_out", "models"))
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/root/venvs/vllm/bin/python"))
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="runs per engine; the median is reported")
    args = ap.parse_args()
    rows = []
    for name in args.workloads:
        w = WORKLOADS[name]
        path = ensure_checkpoint(name, args.models_dir)
        n, i, o = str(w["num_prompts"]), str(w["input_len"]), str(w["output_len"])
        res = {"workload": name}
        res["halserve"] = _median_run([sys.executable, "-m", "halserve.entrypoints.cli", "bench", "throughput", "--model", path,
                                "--platform", "cpu", "--dtype", "float32", "--num-prompts", n, "--input-len", i,
                                "--output-len", o, "--output-json", "{json}"], args.repeats)
        if not args.skip_vllm:
            res["vllm"] = _median_run([args.vllm_python, os.path.join(HERE, "vllm_throughput.py"), path, n, i, o, "--json",
                                       "{json}"], args.repeats,
                                      env={"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"})
        if not args.skip_hf:
            res["transformers"] = _median_run([sys.executable, os.path.join(HERE, "hf_throughput.py"), path, n, i, o, "--json",
                                               "{json}"], 1)
        rows.append(res)
    print("\n| workload | halserve out tok/s | vLLM-CPU out tok/s | transformers out tok/s | halserve/vLLM | halserve/transformers |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        def tps(k):
            return r.get(k)["output_tokens_per_s"] if r.get(k) else None

        h, v, t = tps("halserve"), tps("vllm"), tps("transformers")
        fmt = lambda x: f"{x:.1f}" if x else "n/a"  # noqa: E731
        ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "n/a"  # noqa: E731
        print(f"| {r['workload']} | {fmt(h)} | {fmt(v)} | {fmt(t)} | {ratio(h, v)} | {ratio(h, t)} |")
    for r in rows:
        for k in ("halserve", "vllm"):
            if r.get(k):
                print(f"{r['workload']} {k}: all runs {r[k]['all_output_tokens_per_s']} output tok/s")


if __name__ == "__main__":
    main()
