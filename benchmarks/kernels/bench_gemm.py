"""Benchmark the GEMM kernels: dense fp16/bf16 (torch) vs fp8 (per-token, 128x128-block), int8, AWQ and GPTQ.

    python benchmarks/kernels/bench_gemm.py                    # M in 1,16,128,2048 x N=K=4096 on a GPU
    python benchmarks/kernels/bench_gemm.py -m 4096 -n 14336 -k 4096
    python benchmarks/kernels/bench_gemm.py --tiny             # CPU smoke run (Triton interpreter)

TFLOP/s = 2 M N K / time for every kernel (the same useful work, whatever the storage).
Quantized kernels are timed on pre-quantized inputs: the activation quantization op is
timed separately (it runs once per linear layer too).
"""
from __future__ import annotations

import argparse

from timing import setup_device, time_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", type=int, nargs="+", default=[1, 16, 128, 2048])
    p.add_argument("-n", type=int, default=4096)
    p.add_argument("-k", type=int, default=4096)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="M=4, N=K=128, fp16: a smoke run that works on CPU")
    args = p.parse_args()
    device = setup_device()
    if args.tiny:
        args.m, args.n, args.k, args.iters, args.dtype = [4], 128, 128, 1, "fp16"

    import torch

    from halserve.kernels import packing
    from halserve.platforms.triton_kernels.fp8_block_gemm import TritonFp8BlockScaledGemm, TritonPerTokenGroupFp8Quant
    from halserve.platforms.triton_kernels.fp8_gemm import CudaScaledMmFp8Gemm, TritonFp8ScaledGemm
    from halserve.platforms.triton_kernels.int8_gemm import TritonInt8ScaledGemm
    from halserve.platforms.triton_kernels.quant import TritonScaledFp8Quant
    from halserve.platforms.triton_kernels.wo4_gemm import TritonAwqGemm, TritonGptqGemm

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    n, k = args.n, args.k
    fp8 = torch.float8_e4m3fnuz if torch.version.hip else torch.float8_e4m3fn
    w = torch.randn(n, k, device=device, dtype=dtype) * 0.05
    w8 = w.float().to(fp8)
    sw = torch.full((n, 1), 1.0, device=device)
    block = (128, 128)  # DeepSeek-V3 / Qwen3-FP8 weight blocks; activations per token per 128 features
    sw_block = torch.ones(-(-n // block[0]), -(-k // block[1]), device=device)
    wi8 = torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)
    swi8 = torch.full((n, 1), 1e-4, device=device)  # keeps int32 sums of ~K * 127^2 inside fp16
    q4, zeros, scales = packing.quantize_4bit(w.float().T.cpu(), args.group_size)  # [K, N] layout
    awq = [t.to(device) for t in packing.pack_awq(q4, zeros, scales, dtype=dtype)]
    gptq = [t.to(device) for t in packing.pack_gptq(q4, zeros, scales, dtype=dtype)]

    fp8_kernels = {"fp8 triton": TritonFp8ScaledGemm()}
    if CudaScaledMmFp8Gemm.supports(dtype=str(fp8).removeprefix("torch."), n=n, k=k) is None:
        fp8_kernels["fp8 scaled_mm"] = CudaScaledMmFp8Gemm()
    awq_k, gptq_k, int8_k, quant_k = TritonAwqGemm(), TritonGptqGemm(), TritonInt8ScaledGemm(), TritonScaledFp8Quant()
    block_k, group_quant_k = TritonFp8BlockScaledGemm(), TritonPerTokenGroupFp8Quant()

    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (Triton interpreter)'}; "
          f"N={n} K={k} {args.dtype}, group size {args.group_size}")
    for m in args.m:
        x = torch.randn(m, k, device=device, dtype=dtype)
        x8, sx = quant_k(x, fp8, None, True)
        x8_groups, sx_groups = group_quant_k(x, fp8, block[1])
        xi8 = torch.randint(-127, 128, (m, k), device=device, dtype=torch.int8)
        sxi = torch.rand(m, 1, device=device) * 1e-2
        cases = {
            f"dense {args.dtype}": lambda: torch.nn.functional.linear(x, w),
            **{name: (lambda kern=kern: kern(x8, w8, sx, sw, dtype)) for name, kern in fp8_kernels.items()},
            "fp8 block triton": lambda: block_k(x8_groups, w8, sx_groups, sw_block, block, dtype),
            "int8 triton": lambda: int8_k(xi8, wi8, sxi, swi8, dtype),
            "awq triton": lambda: awq_k(x, *awq, args.group_size),
            "gptq triton": lambda: gptq_k(x, gptq[0], gptq[1], gptq[2], None, args.group_size),
            "fp8 quant (per token)": lambda: quant_k(x, fp8, None, True),
            "fp8 quant (group 128)": lambda: group_quant_k(x, fp8, block[1]),
        }
        for name, fn in cases.items():
            ms = time_ms(fn, device, args.iters)
            tflops = 2 * m * n * k / (ms * 1e-3) / 1e12
            figure = f"{tflops:8.2f} TFLOP/s" if "quant" not in name else f"{m * k * x.element_size() / ms / 1e6:8.1f} GB/s in"
            print(f"M={m:<6d} {name:<22s} {ms:9.3f} ms {figure}")


if __name__ == "__main__":
    main()
