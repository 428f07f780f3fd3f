"""The cpu platform's native paged decode kernel alone, over a many-layer cache that does not fit the L3.

    python benchmarks/kernels/cpu_paged_decode.py [--batch 64] [--context 192] [--layers 30]

Each layer has its own cache (SmolLM2-135M's attention shape by default: 9 q / 3 kv heads of 64, blocks of
16, blocks in random order), so a step reads every layer's K/V from memory as the engine's decode step does.
Prints ms per step (all layers; the last of three timed passes after one warm-up) and the K/V bytes read per
second, for a float32 cache and q, a bfloat16 cache and q, and float32 q over a bfloat16 or float16 cache
(``--kv-cache-dtype bfloat16`` / ``float16``, the second a GGUF model's default); the last two are checked equal to
float32 attention over the same rounded values.
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    from halserve.platforms import cpu_kernels

    kernel = cpu_kernels.load()
    if kernel is None:
        raise SystemExit(f"the cpu kernels could not be built: {cpu_kernels.load_error()}")
    n, hq, hk, d, b = args.batch, args.heads, args.kv_heads, args.head_size, args.block_size
    per_req = -(-args.context // b)
    num_blocks = n * per_req
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, num_blocks, hk, b * d, generator=gen) for _ in range(args.layers)]
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(n, per_req).contiguous()
    lens = torch.full((n,), args.context, dtype=torch.int32)
    q = torch.randn(n, hq, d, generator=gen)
    scale = d**-0.5
    print(f"paged decode: batch {n}, context {args.context}, {hq}/{hk} heads of {d}, block {b}, {args.layers} layers, "
          f"{torch.get_num_threads()} threads")
    print("| q / cache | ms per step | GB/s of K/V |\n|---|---|---|")
    for label, q_dtype, cache_dtype in (("float32 / float32", torch.float32, torch.float32),
                                        ("bfloat16 / bfloat16", torch.bfloat16, torch.bfloat16),
                                        ("float32 / bfloat16", torch.float32, torch.bfloat16),
                                        ("float32 / float16", torch.float32, torch.float16)):
        layer_caches = [c.to(cache_dtype) for c in caches]
        qq = q.to(q_dtype)
        for _ in range(4):  # one warm-up, three timed; the last is printed
            start = time.perf_counter()
            for cache in layer_caches:
                out = kernel.paged_decode(qq, cache, table, lens, b, scale, 0, 0.0)
            seconds = time.perf_counter() - start
        if q_dtype == torch.float32 and cache_dtype != torch.float32:
            want = kernel.paged_decode(q, layer_caches[-1].float(), table, lens, b, scale, 0, 0.0)
            assert torch.equal(out, want), f"float32 q over a {cache_dtype} cache differs from float32 over its values"
        kv_bytes = args.layers * n * args.context * hk * d * 2 * layer_caches[0].element_size()
        print(f"| {label} | {seconds * 1e3:.1f} | {kv_bytes / seconds / 1e9:.1f} |")
        del layer_caches


if __name__ == "__main__":
    main()
