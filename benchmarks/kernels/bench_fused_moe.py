"""Benchmark the fused-MoE op: the Triton kernel (triton_cuda / triton_rocm) against the torch reference.

    python benchmarks/kernels/bench_fused_moe.py                       # Mixtral-8x7B, T in 1..4096, bf16
    python benchmarks/kernels/bench_fused_moe.py -e 60 -k 4 --hidden 2048 --inter 1408   # Qwen1.5-MoE-A2.7B
    python benchmarks/kernels/bench_fused_moe.py --tiny                # CPU smoke run (Triton interpreter)

One call is a whole MoE MLP (align, both grouped GEMMs, the sum over the k slots) for T tokens
routed top-k by random logits. Figures of merit:
  TFLOP/s = 2 T k (H 2I + I H) / time: the useful work of the experts each token visits;
  GB/s    = (weights of the experts that got a token + hidden in + out) / time: the least a
            kernel must move, which bounds decode (few tokens: every active expert's 3 H I
            weights stream through once).
Each row also checks the result against the torch reference (max |error| / max |ref|).
"""
from __future__ import annotations

import argparse

from timing import setup_device, time_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-t", "--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    p.add_argument("-e", "--experts", type=int, default=8)
    p.add_argument("-k", "--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336, help="intermediate size of one expert (one rank's slice)")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-reference", action="store_true", help="skip timing the torch reference")
    p.add_argument("--tiny", action="store_true", help="E=4, H=I=64, T=1,5, fp16: a smoke run that works on CPU")
    args = p.parse_args()
    device = setup_device()
    if args.tiny:
        args.tokens, args.experts, args.hidden, args.inter, args.iters, args.dtype = [1, 5], 4, 64, 64, 1, "fp16"

    import torch

    from halserve.kernels.reference import TorchFusedMoe
    from halserve.platforms.triton_kernels.fused_moe import TritonFusedMoe

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    e, k, h, inter = args.experts, args.top_k, args.hidden, args.inter
    g = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(e, 2 * inter, h, device=device, generator=g) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, device=device, generator=g) * inter ** -0.5).to(dtype)
    triton_moe, torch_moe = TritonFusedMoe(), TorchFusedMoe()
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (Triton interpreter)'}; "
          f"E={e} top_k={k} H={h} I={inter} {args.dtype}")
    for t in args.tokens:
        hidden = torch.randn(t, h, device=device, generator=g).to(dtype)
        logits = torch.randn(t, e, device=device, generator=g)
        topk_weights, topk_ids = logits.softmax(-1).topk(k, dim=-1)
        got = triton_moe(hidden, w13, w2, topk_weights, topk_ids)
        want = torch_moe(hidden, w13, w2, topk_weights, topk_ids)
        rel_err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()
        active = int(torch.unique(topk_ids).numel())
        flops = 2 * t * k * 3 * h * inter
        nbytes = (active * 3 * h * inter + 2 * t * h) * w13.element_size()
        cases = {"triton": lambda: triton_moe(hidden, w13, w2, topk_weights, topk_ids)}
        if not args.no_reference:
            cases["torch reference"] = lambda: torch_moe(hidden, w13, w2, topk_weights, topk_ids)
        for name, fn in cases.items():
            ms = time_ms(fn, device, args.iters)
            print(f"T={t:<5d} {name:<16s} {ms:9.3f} ms {flops / (ms * 1e-3) / 1e12:8.2f} TFLOP/s "
                  f"{nbytes / (ms * 1e-3) / 1e9:8.1f} GB/s  ({active}/{e} experts active"
                  + (f", max err {rel_err:.1e} of max |ref|)" if name == "triton" else ")"))


if __name__ == "__main__":
    main()
