"""Benchmark the triton_paged backend: decode bandwidth and prefill throughput.

    python benchmarks/kernels/bench_paged_attention.py                 # H100 defaults
    python benchmarks/kernels/bench_paged_attention.py --peak-gbps 4800 # H200
    python benchmarks/kernels/bench_paged_attention.py --tiny          # CPU smoke run (Triton interpreter)

Decode: ``--batch`` requests with ``--context`` cached tokens each, one new token. Figure of
merit: achieved bandwidth = bytes of K and V read (the whole context of every request,
every kv head) / time, and its share of ``--peak-gbps`` (H100 SXM: ~3350 GB/s).
Two references measured in the same process, on the same device, put the figure in context:
the device-to-device copy bandwidth (``tensor.copy_`` of 1 GiB, bytes read + written: what
the part delivers in practice, below the data-sheet peak) and torch's own
``scaled_dot_product_attention`` decoding the same shape from contiguous (not paged) K/V,
the vendor kernel our paged kernel has to match (``--no-reference`` skips both).
Prefill: ``--prefill-batch`` fresh prompts of ``--prefill-len`` tokens; TFLOP/s counts the
causal half of QK^T and PV: 2 * 2 * (L^2 / 2) * head_size * num_heads per prompt.
Each timed call is a full backend forward (the cache write of the step's K/V included).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os

from timing import setup_device, time_ms

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@contextlib.contextmanager
def forced_env(forced: dict[str, str]):
    """HALSERVE_TRITON_ATTN_<name> = value for each item, for the duration of the block."""
    os.environ.update({f"HALSERVE_TRITON_ATTN_{name}": value for name, value in forced.items()})
    try:
        yield
    finally:
        for name in forced:
            del os.environ[f"HALSERVE_TRITON_ATTN_{name}"]


def make_step(specs, *, num_heads, num_kv_heads, head_size, block_size, dtype, device, kv_cache_dtype):
    """Inputs of one step: specs = [(num_cached, query_len)] per request; blocks in shuffled order."""
    import torch

    from halserve.attention_backends.base import AttentionMetadata

    blocks_per_req = [math.ceil((c + n) / block_size) for c, n in specs]
    num_blocks = sum(blocks_per_req)
    perm = torch.randperm(num_blocks, dtype=torch.int32)
    block_table = torch.zeros(len(specs), max(blocks_per_req), dtype=torch.int32)
    slots, used = [], 0
    for r, ((cached, n), nb) in enumerate(zip(specs, blocks_per_req)):
        block_table[r, :nb] = perm[used : used + nb]
        used += nb
        for pos in range(cached, cached + n):
            slots.append(int(block_table[r, pos // block_size]) * block_size + pos % block_size)
    num_tokens = sum(n for _, n in specs)
    cache_dtype = dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, device=device).to(cache_dtype)
    q = torch.randn(num_tokens, num_heads, head_size, device=device, dtype=dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_size, device=device, dtype=dtype)
    v = torch.randn_like(k)
    qsl = torch.tensor([0] + [n for _, n in specs], dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([c + n for c, n in specs], dtype=torch.int32)
    md = AttentionMetadata(
        num_actual_tokens=num_tokens, num_reqs=len(specs), max_query_len=max(n for _, n in specs),
        max_seq_len=int(seq_lens.max()), query_start_loc=qsl.to(device), seq_lens=seq_lens.to(device),
        block_table=block_table.to(device), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )
    return q, k, v, kv_cache, md


def copy_bandwidth(device: str, nbytes: int) -> float:
    """GB/s of a device-to-device ``copy_`` of ``nbytes``, counting the bytes read and written."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, iters=10)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def sdpa_decode_ms(args, dtype, device: str) -> float:
    """torch's scaled_dot_product_attention on the decode shape, K/V contiguous per request
    ([batch, kv heads, context, head size]; on an H100 flash or memory-efficient attention)."""
    import torch
    import torch.nn.functional as F

    q = torch.randn(args.batch, args.num_heads, 1, args.head_size, device=device, dtype=dtype)
    k = torch.randn(args.batch, args.num_kv_heads, args.context, args.head_size, device=device, dtype=dtype)
    v = torch.randn_like(k)
    return time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), device, args.iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    p.add_argument("--prefill-batch", type=int, default=4)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--peak-gbps", type=float, default=3350.0, help="HBM peak, GB/s (H100 SXM ~3350, H200 ~4800)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="tiny sizes, fp16: a smoke run that works on CPU")
    p.add_argument("--decode-only", action="store_true", help="skip prefill")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the copy-bandwidth and torch SDPA references of the decode figure")
    p.add_argument("--sweep", action="store_true",
                   help="also time decode at every forced pipeline depth (3, 4, 5) x split-K factor (1, 2, 4, 8), "
                        "then other (keys per tile, warps) at depths 3, 5 x splits 2, 4, and prefill at depths 3 "
                        "and 5 (HALSERVE_TRITON_ATTN_STAGES / _SPLITS)")
    p.add_argument("--grid", action="store_true",
                   help="decode only: a table of batch (8..128) x context (1K, 4K, 16K), each at the defaults and "
                        "at every depth (3, 4, 5) x split-K factor (1, 2, 4, 8), in %% of --peak-gbps")
    args = p.parse_args()
    device = setup_device()
    if args.tiny:
        args.batch, args.context, args.num_heads, args.num_kv_heads, args.head_size = 2, 64, 4, 2, 64
        args.prefill_batch, args.prefill_len, args.iters = 1, 32, 1
        args.dtype = "fp16" if args.dtype == "bf16" else args.dtype  # the interpreter cannot compute bf16

    import torch

    from halserve.attention_backends import triton_paged_kernels as kernels
    from halserve.attention_backends.triton_paged import TritonPagedAttentionBackend

    dtype = getattr(torch, DTYPES[args.dtype])
    backend = TritonPagedAttentionBackend(args.num_heads, args.head_size, args.head_size**-0.5, args.num_kv_heads,
                                          kv_cache_dtype=args.kv_cache_dtype)
    common = dict(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_size=args.head_size,
                  block_size=args.block_size, dtype=dtype, device=device, kv_cache_dtype=args.kv_cache_dtype)
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (Triton interpreter)'}")

    shape = f"heads={args.num_heads}/{args.num_kv_heads} d={args.head_size} {args.dtype}"

    def run(step, what: str, figure, forced: dict[str, str], tiles: tuple[int, int] | None = None) -> None:
        """Time one backend forward of ``step`` and print one line. ``forced`` sets
        HALSERVE_TRITON_ATTN_* values for this run; ``tiles`` = (TILE_N, num_warps) replaces the
        launcher's tile choice (a sweep of the benchmark's own, not a backend knob). A
        configuration that fails to build or launch prints why and the sweep goes on."""
        q, k, v, kv_cache, md = step
        if tiles is not None:
            kernels.tile_sizes = lambda *a: (*default_tile_sizes(*a)[:2], *tiles)
        try:
            with forced_env(forced):
                _, _, tile_n, warps = kernels.tile_sizes(args.num_heads // args.num_kv_heads, md.max_query_len,
                                                         args.head_size, dtype)
                num_splits = backend.num_kv_splits(md, q.device)
                stages = (forced.get("STAGES") or kernels.pipeline_stages(md.max_query_len, num_splits)
                          or "triton default")
                splits = f" splits={num_splits}" if md.max_query_len == 1 else ""
                label = (f"{what} {shape}{splits} stages={stages} tile_n={tile_n} warps={warps}"
                         f"{'' if forced or tiles else ' (defaults)'}")
                try:
                    ms = time_ms(lambda: backend.forward(q, k, v, kv_cache, md), device, args.iters)
                except Exception as exc:  # OutOfResources and friends: report, keep sweeping
                    print(f"{label}: failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                    return
                print(f"{label}: {ms:.3f} ms, {figure(ms)}")
        finally:
            kernels.tile_sizes = default_tile_sizes

    default_tile_sizes = kernels.tile_sizes
    if args.grid:
        decode_grid(args, backend, kernels, common, device)
        return
    # decode: each request reads its whole context once per kv head
    step = make_step([(args.context - 1, 1)] * args.batch, **common)
    step_element_size = step[3].element_size()
    kv_bytes = 2 * args.batch * args.context * args.num_kv_heads * args.head_size * step_element_size

    def bandwidth(ms: float, nbytes: int = kv_bytes) -> str:
        gbps = nbytes / (ms * 1e-3) / 1e9
        return f"{gbps:.1f} GB/s = {100 * gbps / args.peak_gbps:.1f}% of {args.peak_gbps:.0f} GB/s"

    decode = f"decode  batch={args.batch} context={args.context} kv={args.kv_cache_dtype}"
    run(step, decode, bandwidth, {})
    if not args.no_reference:
        print(f"reference: device copy {copy_bandwidth(device, 64 << 20 if args.tiny else 1 << 30):.1f} GB/s "
              "(tensor.copy_, bytes read + written)")
        ms = sdpa_decode_ms(args, dtype, device)
        sdpa_bytes = kv_bytes // step_element_size * dtype.itemsize  # SDPA reads K/V in the model dtype
        print(f"reference: torch SDPA decode, contiguous K/V, {shape}: {ms:.3f} ms, {bandwidth(ms, sdpa_bytes)}")
    if args.sweep:
        # pipeline depth x split-K factor at the launcher's tiles, then other (keys per tile, warps)
        for stages in ("3", "4", "5"):
            for splits in ("1", "2", "4", "8"):
                run(step, decode, bandwidth, {"STAGES": stages, "SPLITS": splits})
        for tiles in ((32, 4), (64, 8), (128, 4), (128, 8)):
            for stages in ("3", "5"):
                for splits in ("2", "4"):
                    run(step, decode, bandwidth, {"STAGES": stages, "SPLITS": splits}, tiles)
    if args.decode_only:
        return
    del step  # the decode cache: room for the prefill's
    # prefill: fresh prompts, causal
    step = make_step([(0, args.prefill_len)] * args.prefill_batch, **common)
    flops = args.prefill_batch * 2 * args.prefill_len**2 * args.head_size * args.num_heads
    prefill = f"prefill batch={args.prefill_batch} len={args.prefill_len}"
    tflops = lambda ms: f"{flops / (ms * 1e-3) / 1e12:.2f} TFLOP/s"  # noqa: E731
    run(step, prefill, tflops, {})
    for stages in ("3", "5") if args.sweep else ():
        run(step, prefill, tflops, {"STAGES": stages})


def decode_grid(args, backend, kernels, common, device) -> None:
    """One row per (batch, context): decode bandwidth in % of ``--peak-gbps`` at the backend's
    defaults, then at each forced depth x split-K factor; the defaults' choice is named."""
    configs = [(stages, splits) for stages in ("3", "4", "5") for splits in ("1", "2", "4", "8")]
    batches, contexts = ((2, 4), (64, 256)) if args.tiny else ((8, 16, 32, 64, 128), (1024, 4096, 16384))
    print(f"decode grid, heads={args.num_heads}/{args.num_kv_heads} d={args.head_size} {args.dtype} "
          f"block={args.block_size}: % of {args.peak_gbps:.0f} GB/s")
    print(f"{'batch':>5} {'context':>7} {'defaults':>18} " + " ".join(f"{'st' + a + '/s' + b:>7}" for a, b in configs))
    for context in contexts:
        for batch in batches:
            q, k, v, kv_cache, md = make_step([(context - 1, 1)] * batch, **common)
            kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_size * kv_cache.element_size()

            def percent(forced: dict[str, str]) -> str:
                try:
                    with forced_env(forced):
                        # (ruff reads the `del` below as before the call: percent runs first)
                        ms = time_ms(lambda: backend.forward(q, k, v, kv_cache, md),  # noqa: F821
                                     device, args.iters)
                    return f"{100 * kv_bytes / (ms * 1e-3) / 1e9 / args.peak_gbps:.1f}"
                except Exception as exc:  # a configuration that cannot build: say so, go on
                    return type(exc).__name__[:7]

            num_splits = backend.num_kv_splits(md, q.device)
            chosen = f"st{kernels.pipeline_stages(1, num_splits) or '-'}/s{num_splits}"
            row = f"{percent({}):>6} ({chosen})"
            print(f"{batch:>5} {context:>7} {row:>18} "
                  + " ".join(f"{percent({'STAGES': a, 'SPLITS': b}):>7}" for a, b in configs), flush=True)
            del q, k, v, kv_cache, md


if __name__ == "__main__":
    main()
