"""Side-by-side image throughput (workload V1): halserve vs vLLM's CPU build, in one run.

    python benchmarks/compare_mm_throughput.py [--repeats 3] [--num-prompts 64] [--output-len 64]
        [--models-dir bench_out/models] [--vllm-python PATH] [--skip-vllm]

Writes the V1 checkpoint if it is missing (``workloads.ensure_checkpoint``), then runs
``benchmarks/mm_throughput.py`` ``--repeats`` times per engine, each run in a fresh process,
alternating (halserve, vLLM, halserve, ...: the machine's speed drifts, and alternating spreads the
drift over both), vLLM from its own venv under ``VLLM_CPU_OMP_THREADS_BIND=0-1
VLLM_CPU_KVCACHE_SPACE=4``. Prints each engine's median run (by output tok/s) and all runs, the
ratios, and how far the two engines' greedy outputs agree (float32: most tokens should).
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare_throughput import _median, _run  # noqa: E402
from workloads import MM_WORKLOADS, ensure_checkpoint  # noqa: E402

WORKLOAD = "V1"
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}


def _agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """How far two engines' greedy outputs (one id list per request) agree."""
    same_requests = sum(x == y for x, y in zip(a, b))
    tokens = sum(len(x) for x in a)
    same_tokens = sum(p == q for x, y in zip(a, b) for p, q in zip(x, y))
    # tokens before each request's first difference: after one, the contexts differ
    prefix = sum(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y))) for x, y in zip(a, b))
    return (f"{same_requests}/{len(a)} requests identical; {same_tokens}/{tokens} tokens equal at their position; "
            f"{prefix}/{tokens} before each request's first difference")


def main() -> None:
    w = MM_WORKLOADS[WORKLOAD]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models-dir", default=os.path.join("bench_out", "models"))
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/root/venvs/vllm/bin/python"))
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="runs per engine; the median is reported")
    ap.add_argument("--num-prompts", type=int, default=w["num_prompts"])
    ap.add_argument("--output-len", type=int, default=w["output_len"])
    args = ap.parse_args()
    path = ensure_checkpoint(WORKLOAD, args.models_dir)
    script = os.path.join(HERE, "mm_throughput.py")
    common = [path, "--num-prompts", str(args.num_prompts), "--output-len", str(args.output_len), "--json", "{json}"]
    engines = {"halserve": ([sys.executable, script, "--engine", "halserve", *common], None)}
    if not args.skip_vllm:
        engines["vllm"] = ([args.vllm_python, script, "--engine", "vllm", *common], VLLM_ENV)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(args.repeats):  # A B A B ...
        for name, (cmd, env) in engines.items():
            result = _run(cmd, env)
            if result:
                print(f"  -> {name}: {result['elapsed_s']:.2f} s, {result['output_tokens_per_s']:.1f} output tok/s, "
                      f"{result['total_tokens_per_s']:.1f} total tok/s", flush=True)
                runs[name].append(result)
    best = {name: _median(r) for name, r in runs.items()}

    print(f"\n{WORKLOAD}: {args.num_prompts} prompts x (1 image = 196 tokens + {w['text_len']} text tokens), "
          f"{args.output_len} output tokens each; median of {args.repeats} runs per engine")
    print("| engine | elapsed s | requests/s | output tok/s | total tok/s |")
    print("|---|---|---|---|---|")
    for name, r in best.items():
        if r:
            print(f"| {name} | {r['elapsed_s']:.2f} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} "
                  f"| {r['total_tokens_per_s']:.1f} |")
        else:
            print(f"| {name} | n/a | n/a | n/a | n/a |")
    for name, r in best.items():
        if r:
            print(f"{name}: all runs {r['all_output_tokens_per_s']} output tok/s")
    h, v = best.get("halserve"), best.get("vllm")
    if h and v:
        print(f"halserve / vLLM: {h['output_tokens_per_s'] / v['output_tokens_per_s']:.2f}x output tok/s, "
              f"{h['total_tokens_per_s'] / v['total_tokens_per_s']:.2f}x total tok/s")
        if h["num_prompt_tokens"] != v["num_prompt_tokens"]:
            print(f"WARNING: prompt tokens differ: halserve {h['num_prompt_tokens']}, vLLM {v['num_prompt_tokens']}")
        print(f"greedy outputs: {_agreement(h['output_token_ids'], v['output_token_ids'])}")
        print(f"first request: halserve {h['first_output_token_ids']}")
        print(f"               vLLM     {v['first_output_token_ids']}")


if __name__ == "__main__":
    main()
