"""How many long requests run at once in a fixed KV-cache budget: every layer full-length (one group,
as before issue 29) against per-group tables where sliding-window layers keep only their window.

    python benchmarks/kv_cache_groups.py [--layers 62] [--pattern 6] [--window 1024] [--context 8192]

Gemma-3-27B-shaped by default: 62 layers, every 6th full attention (10 full, 52 sliding), a 1k window,
8k-token requests (8000 prompt + 192 generated), block size 16, prefill chunks of 2048 tokens. The
budget is the same number of bytes both ways: ``--budget-blocks`` blocks of the all-full layout (each
holding every layer); the hybrid layout's blocks hold ``group_size`` layers, so there are
``budget * layers / group_size`` of them. The scheduler runs for real (admission, chunked prefill,
preemption) against a worker that only samples token 7; no model, no device.
"""
from __future__ import annotations

import argparse
import time

from halserve.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec, group_layers, group_size
from halserve.request import Request
from halserve.sampling_params import SamplingParams
from halserve.scheduler import Scheduler, SchedulerConfig
from halserve.scheduler_output import ModelRunnerOutput


def run(specs, num_blocks: int, args) -> tuple[int, int, float]:
    """(most requests running at once, preemptions, seconds) for ``args.num_requests`` requests."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=args.chunk,
                                      max_model_len=args.context, block_size=args.block_size,
                                      num_blocks=num_blocks, kv_cache_specs=tuple(specs)))
    prompt_len = args.context - args.output
    for i in range(args.num_requests):
        prompt = [i + 3] + [(i * 7 + j) % 1000 + 3 for j in range(prompt_len - 1)]
        sched.add_request(Request(request_id=f"r{i}", prompt_token_ids=prompt, max_tokens=args.output,
                                  sampling_params=SamplingParams(max_tokens=args.output, ignore_eos=True)))
    most = 0
    start = time.perf_counter()
    while sched.has_unfinished_requests():
        so = sched.schedule()
        most = max(most, sum(1 for r in sched.running if r.num_computed_tokens >= prompt_len))
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            req = sched.requests[req_id]
            done = req.num_computed_tokens + so.num_scheduled_tokens[req_id] >= req.num_tokens
            sampled.append([7] if done else [])
        sched.update_from_output(so, ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids)))
    return most, sched.num_preemptions, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=62)
    parser.add_argument("--pattern", type=int, default=6, help="every N-th layer is full attention")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--output", type=int, default=192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--budget-blocks", type=int, default=2048, help="all-full-layout blocks (every layer)")
    parser.add_argument("--num-requests", type=int, default=32)
    args = parser.parse_args()

    specs = [FullAttentionSpec() if (i + 1) % args.pattern == 0 else SlidingWindowSpec(args.window)
             for i in range(args.layers)]
    groups = group_layers(specs)
    size = group_size(groups)
    hybrid_blocks = args.budget_blocks * args.layers // size
    print(f"{args.layers} layers ({sum(isinstance(s, FullAttentionSpec) for s in specs)} full, window {args.window}), "
          f"{args.context}-token requests, block size {args.block_size}, chunk {args.chunk}")
    print(f"budget: {args.budget_blocks} blocks of {args.layers} layers = {hybrid_blocks} blocks of {size} layers "
          f"({len(groups)} groups)")
    before = run([FullAttentionSpec()] * args.layers, args.budget_blocks + 1, args)
    after = run(specs, hybrid_blocks + 1, args)
    for name, (most, preemptions, seconds) in (("before (one full-length group)", before),
                                               ("after (per-group tables)", after)):
        print(f"  {name:32s} {most:3d} requests decoding at once, {preemptions} preemptions ({seconds:.1f} s)")
    print(f"  ratio {after[0] / max(1, before[0]):.1f}x")


if __name__ == "__main__":
    main()
