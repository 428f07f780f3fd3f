"""Quantized checkpoints side by side: halserve vs vLLM's CPU build on W1 and its quantized copies.

    python benchmarks/compare_quantized.py [--formats float gptq awq w8a8] [--repeats 2] [--dtype bfloat16]

The checkpoints: ``benchmarks/workloads.py bench_out W1`` and ``benchmarks/quantized_workloads.py
bench_out/W1 bench_out`` (made here when missing). W1's prompts and lengths; each engine in fresh
processes, alternating, median reported (``compare_throughput.py``'s runner). Both engines run
``--dtype`` activations (default bfloat16), except that vLLM's CPU build takes these quantized
checkpoints only in bfloat16 (its int8 GEMM refuses float32): with ``--dtype float32`` it still runs
them in bfloat16, and the table says so.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare_throughput import _interleaved  # noqa: E402
from workloads import WORKLOADS  # noqa: E402


def checkpoint(fmt: str, root: str) -> str:
    base = os.path.join(root, "W1")
    if not os.path.isdir(base):
        subprocess.run([sys.executable, os.path.join(HERE, "workloads.py"), root, "W1"], check=True)
    if fmt == "float":
        return base
    path = f"{base}-{fmt}"
    if not os.path.isdir(path):
        subprocess.run([sys.executable, os.path.join(HERE, "quantized_workloads.py"), base, root, fmt], check=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=["float", "gptq", "awq", "w8a8"])
    ap.add_argument("--root", default="bench_out")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/root/venvs/vllm/bin/python"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    w = WORKLOADS["W1"]
    n, i, o = str(w["num_prompts"]), str(w["input_len"]), str(w["output_len"])
    rows = []
    for fmt in args.formats:
        path = checkpoint(fmt, args.root)
        vllm_dtype = args.dtype if fmt == "float" else "bfloat16"
        engines = {
            "halserve": ([sys.executable, "-m", "halserve.entrypoints.cli", "bench", "throughput", "--model", path,
                          "--platform", "cpu", "--dtype", args.dtype, "--num-prompts", n, "--input-len", i,
                          "--output-len", o, "--output-json", "{json}"], None),
            "vllm": ([args.vllm_python, os.path.join(HERE, "vllm_throughput.py"), path, n, i, o, "--dtype", vllm_dtype,
                      "--json", "{json}"], {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}),
        }
        rows.append((fmt, vllm_dtype, _interleaved(engines, args.repeats)))
    print(f"\n| W1 checkpoint | halserve ({args.dtype}) out tok/s | vLLM-CPU out tok/s (dtype) | halserve / vLLM |")
    print("|---|---|---|---|")
    for fmt, vllm_dtype, res in rows:
        h, v = (res[k]["output_tokens_per_s"] if res.get(k) else None for k in ("halserve", "vllm"))
        ratio = f"{h / v:.2f}x" if h and v else "n/a"
        print(f"| {fmt} | {h or 'n/a':.6} | {v or 'n/a':.6} ({vllm_dtype}) | {ratio} |")
    for fmt, _, res in rows:
        for k in ("halserve", "vllm"):
            if res.get(k):
                print(f"{fmt} {k}: all runs {res[k]['all_output_tokens_per_s']} output tok/s")


if __name__ == "__main__":
    main()
