"""GGUF decode throughput at several stream counts (offline ``LLM``, CPU): the figures of BENCHMARKS.md's GGUF
section ("the LM head at many rows").

    python benchmarks/gguf_decode.py [--model PATH] [--streams 1 16 64] [--tokens 128 64 32] [--repeats 2]

``--model`` defaults to SmolLM2-135M-Instruct's Q4_1 GGUF from scripts/get_smollm2.sh. Each stream count runs
that many 2-token random prompts, greedy with ``ignore_eos``, for its number of tokens; decode tok/s is
(streams x (tokens - 1)) over the time of the run less the time of the same prompts with one token (their
prefill and first token), best of ``--repeats``. The GGUF blocks run as stored (``quantization="gguf"``,
float32 activations). Prints one line per stream count, then the process's peak RSS.
"""
from __future__ import annotations

import argparse
import os
import random
import resource
import subprocess
import sys
import time


def default_model() -> str:
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "get_smollm2.sh")
    done = subprocess.run(["bash", script], capture_output=True, text=True)
    path = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0 or not os.path.exists(path):
        sys.exit(f"scripts/get_smollm2.sh did not give a model ({done.stderr.strip()[-300:]}); pass --model PATH")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: scripts/get_smollm2.sh's Q4_1)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 64, 32],
                        help="tokens per stream, one per --streams entry")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if len(args.tokens) != len(args.streams):
        sys.exit(f"--tokens needs one count per --streams entry ({len(args.streams)}), got {len(args.tokens)}")
    path = args.model or default_model()

    from halserve import LLM, SamplingParams

    llm = LLM(path, platform="cpu", quantization="gguf", dtype="float32", max_model_len=512,
              enable_prefix_caching=False)
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)

    def run(streams: int, tokens: int) -> float:
        prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(2)]} for _ in range(streams)]
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    run(max(args.streams), 4)  # warm-up: allocations, kernel selection
    print(f"model {os.path.basename(path)}, torch threads {__import__('torch').get_num_threads()}")
    for streams, tokens in zip(args.streams, args.tokens):
        best = 0.0
        for _ in range(args.repeats):
            first = run(streams, 1)
            total = run(streams, tokens)
            best = max(best, streams * (tokens - 1) / max(total - first, 1e-9))
        print(f"{streams:3d} streams x {tokens:4d} tokens: decode {best:7.1f} tok/s", flush=True)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
