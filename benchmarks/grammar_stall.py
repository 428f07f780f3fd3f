"""How long a slow structured-output grammar holds up the other requests' steps.

Sixteen unconstrained requests decode on W2; after 20 steps a request arrives whose grammar
has ``--rules`` rules in a row, each a choice over W2's word tokens (slow to compile: ~1.2 s at
3,000 rules against W2's vocabulary of 8,192; a real tokenizer's 150k makes every compile
slower). A small constrained request runs first, so the tokenizer is loaded before the clock
starts. The script prints the median step before the slow request, the longest gaps between
two consecutive steps of the unconstrained requests after it arrived, and when its first
token came.

    python benchmarks/grammar_stall.py [--model bench_out/models/W2] [--rules 3000]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench_out/models/W2")
    parser.add_argument("--rules", type=int, default=3000)
    args = parser.parse_args()
    if not os.path.exists(os.path.join(args.model, "model.safetensors")):
        sys.path.insert(0, os.path.dirname(__file__))
        from workloads import ensure_checkpoint

        args.model = ensure_checkpoint("W2", os.path.dirname(args.model) or ".")

    from halserve import LLM, SamplingParams

    llm = LLM(args.model, platform="cpu", dtype="float32", enable_prefix_caching=False)
    engine = llm.llm_engine
    n = args.rules
    grammar = "root ::= " + " ".join(f"r{i}" for i in range(n)) + "\n" + "\n".join(
        f'r{i} ::= "w{i + 3}" | "w{(i * 7) % 8000 + 3}" "w{(i * 13) % 8000 + 3}"' for i in range(n))
    warm = SamplingParams(temperature=0.0, max_tokens=2, structured_outputs={"grammar": 'root ::= "w3" "w4"'})
    llm.generate({"prompt_token_ids": [9] * 8}, warm, use_tqdm=False)
    plain = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i in range(16):
        engine.add_request(f"plain-{i}", {"prompt_token_ids": [5 + i] * 32}, plain)
    steps: list[float] = []  # when each step that gave the plain requests a token returned
    first_token = None
    added = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        if any(o.request_id.startswith("plain") for o in outs):
            steps.append(now)
        if len(steps) == 20 and added is None:
            engine.add_request("constrained", {"prompt_token_ids": [7] * 32},
                               SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={"grammar": grammar}))
            added = now
        if first_token is None and any(o.request_id == "constrained" and o.outputs[0].token_ids for o in outs):
            first_token = now
            break
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    after = [b - a for a, b in zip(steps[19:], steps[20:])]
    print(f"rules: {n}")
    print(f"median step: {statistics.median(gaps[:19]) * 1e3:.1f} ms (before the slow request)")
    print("longest step gaps after it arrived: " + ", ".join(f"{g * 1e3:.1f}" for g in sorted(after)[::-1][:5])
          + f" ms ({len(after)} steps)")
    print(f"its first token came {(first_token - added) * 1e3:.0f} ms after it arrived" if first_token
          else "it produced no token")


if __name__ == "__main__":
    main()
