"""Throughput of the Transformers modeling backend against the native path, side by side in one run.

    python benchmarks/transformers_backend.py [--model DIR] [--num-prompts N] [--input-len N]
                                              [--output-len N] [--repeats R]

Defaults are W1's (``benchmarks/workloads.py``: 64 prompts x 128 random tokens, 128 output tokens;
its checkpoint under bench_out/models/W1, written when missing). Each implementation runs in a
fresh process (``--model-impl halserve`` then ``transformers``, alternating ``--repeats`` times), CPU
platform, float32, greedy, ignore_eos; prints output tok/s of each run and the ratio of the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = r"""
import json, random, sys, time
from halserve import LLM, SamplingParams
model, impl, n, inp, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = LLM(model, platform="cpu", dtype="float32", model_impl=impl, seed=0)
vocab = llm.llm_engine.model_info.vocab_size
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(inp)]} for _ in range(n)]
params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
start = time.perf_counter()
outputs = llm.generate(prompts, params, use_tqdm=False)
elapsed = time.perf_counter() - start
tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
print(json.dumps({"impl": impl, "output_tokens_per_s": tokens / elapsed, "elapsed_s": elapsed,
                  "first_tokens": outputs[0].outputs[0].token_ids[:8]}))
"""


def main() -> None:
    sys.path.insert(0, HERE)
    from workloads import WORKLOADS, ensure_checkpoint

    w1 = WORKLOADS["W1"]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: W1's, written when missing)")
    p.add_argument("--num-prompts", type=int, default=w1["num_prompts"])
    p.add_argument("--input-len", type=int, default=w1["input_len"])
    p.add_argument("--output-len", type=int, default=w1["output_len"])
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    model = args.model or ensure_checkpoint("W1", os.path.join(HERE, "..", "bench_out", "models"))
    runs: dict[str, list[dict]] = {"halserve": [], "transformers": []}
    for _ in range(args.repeats):
        for impl in runs:
            cmd = [sys.executable, "-c", CHILD, model, impl, str(args.num_prompts), str(args.input_len),
                   str(args.output_len)]
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            result = json.loads(line)
            runs[impl].append(result)
            print(json.dumps(result))
    medians = {impl: statistics.median(r["output_tokens_per_s"] for r in rs) for impl, rs in runs.items()}
    same = runs["halserve"][0]["first_tokens"] == runs["transformers"][0]["first_tokens"]
    print(f"output tok/s: native {medians['halserve']:.1f}, transformers backend {medians['transformers']:.1f}, "
          f"ratio {medians['transformers'] / medians['halserve']:.3f} (first tokens identical: {same})")


if __name__ == "__main__":
    main()
