"""Side-by-side throughput: halserve vs vLLM's CPU build vs transformers, in one run.

    python benchmarks/compare_throughput.py [--workloads W1 W2] [--vllm-python PATH] [--skip-hf]

Each engine runs in its own fresh process, on the same checkpoint and the same random
prompts, ``--repeats`` times for halserve and vLLM, alternating (halserve, vLLM, halserve,
vLLM, ...: the machine's speed drifts, and alternating spreads the drift over both); the
median run of each is reported and all runs are printed. transformers runs once. vLLM runs from its own venv (it pins its own torch build); see
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


def _median(runs: list[dict]) -> dict | None:
    """The run with the median output tok/s, with every run's figure attached."""
    if not runs:
        return None
    runs = sorted(runs, key=lambda r: r["output_tokens_per_s"])
    best = dict(runs[len(runs) // 2])
    best["all_output_tokens_per_s"] = [round(r["output_tokens_per_s"], 1) for r in runs]
    return best


def _interleaved(engines: dict[str, tuple[list[str], dict | None]], repeats: int) -> dict[str, dict | None]:
    """Run each engine's command ``repeats`` times in fresh processes, alternating engines
    (A B A B ...) so that slow drift in the machine's speed hits them alike; the median
    run of each."""
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, (cmd, env) in engines.items():
            result = _run(cmd, env)
            if result:
                runs[name].append(result)
    return {name: _median(r) for name, r in runs.items()}


def _run(cmd: list[str], env: dict | None = None) -> dict | None:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [c.replace("{json}", out) for c in cmd]
    print("$", " ".join(cmd), flush=True)
    # (every engine runs outside the checkout, as compare_serving.py's servers do: from its root, vLLM's
    # `python -m` model inspection puts the repository's top-level folders on sys.path and imports this
    # repository's kernels/ as the `kernels` package, and fails)
    proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, text=True, capture_output=True,
                          cwd=tempfile.gettempdir())
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
        path = os.path.abspath(ensure_checkpoint(name, args.models_dir))  # (the engines run in a temporary folder)
        n, i, o = str(w["num_prompts"]), str(w["input_len"]), str(w["output_len"])
        res = {"workload": name}
        engines = {"halserve": ([sys.executable, "-m", "halserve.entrypoints.cli", "bench", "throughput", "--model", path,
                                 "--platform", "cpu", "--dtype", "float32", "--num-prompts", n, "--input-len", i,
                                 "--output-len", o, "--output-json", "{json}"], None)}
        if not args.skip_vllm:
            engines["vllm"] = ([args.vllm_python, os.path.join(HERE, "vllm_throughput.py"), path, n, i, o, "--json",
                                "{json}"], {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"})
        res.update(_interleaved(engines, args.repeats))
        if not args.skip_hf:
            res["transformers"] = _median([r for r in [_run([sys.executable, os.path.join(HERE, "hf_throughput.py"), path,
                                                             n, i, o, "--json", "{json}"])] if r])
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
