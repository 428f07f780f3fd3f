"""Benchmark the cpu platform's native quantized GEMMs (``cpu_native``: 4-bit GPTQ, fp8 W8A8) against
the dense bf16 GEMM they stand in for and the kernels they replaced, bfloat16 activations.

    python benchmarks/kernels/cpu_native_gemm.py                       # W1's shapes and 4096x4096
    python benchmarks/kernels/cpu_native_gemm.py --shapes 4096x4096 -m 1 64

Per (K x N, M), milliseconds per call (median of the calls that fit ``--budget`` seconds):
- ``dense bf16``: the ``gemm`` op's oneDNN kernel, weight prepacked (what a bf16 checkpoint runs);
- ``int4pack``: torch's int4 kernel (``torch_int4pack``), GPTQ group 128, prepared once;
- ``int4 amx`` / ``int4 avx512``: the native 4-bit kernel on each of its paths (the AVX512-BF16 one is
  what CPUs without AMX run);
- ``fp8 ref``: the torch reference of ``fp8_scaled_gemm`` (what fp8 checkpoints ran before), per-token
  and per-channel scales, only where it takes under a second;
- ``fp8 amx``: the native fp8 kernel, the activation already quantized.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable


def median_ms(fn: Callable[[], object], budget_s: float, max_calls: int = 30) -> float:
    t0 = time.perf_counter()
    fn()  # warm-up, and the estimate of how many calls fit the budget
    first = time.perf_counter() - t0
    samples = []
    for _ in range(max(2, min(max_calls, int(budget_s / max(first, 1e-6))))):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return samples[len(samples) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["768x2304", "768x4096", "2048x768", "4096x4096"],
                    help="KxN weight shapes")
    ap.add_argument("-m", nargs="+", type=int, default=[1, 4, 16, 64, 256, 2048])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=float, default=0.5, help="seconds per measurement")
    args = ap.parse_args()

    import torch

    from halserve.kernels import packing
    from halserve.kernels.reference import TorchFp8ScaledGemm
    from halserve.platforms.cpu_kernels.native_fp8 import NativeFp8ScaledGemm
    from halserve.platforms.cpu_kernels.native_int4 import NativeInt4GptqGemm
    from halserve.platforms.cpu_kernels.quant_gemm import CpuInt4GptqGemm

    torch.set_num_threads(args.threads)
    int4, int4pack, fp8, fp8_ref = NativeInt4GptqGemm(), CpuInt4GptqGemm(), NativeFp8ScaledGemm(), TorchFp8ScaledGemm()
    isa = int4.isa
    print(f"native ISA: {isa}; {args.threads} threads; bf16 activations; ms per call\n")
    print("| K x N | M | dense bf16 | int4pack | int4 amx | int4 avx512 | fp8 ref | fp8 amx |")
    print("|---|---|---|---|---|---|---|---|")
    e4m3 = torch.float8_e4m3fn
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        w = torch.randn(k, n) * 0.02  # [K, N]
        dense = torch.ops.mkldnn._reorder_linear_weight(w.T.contiguous().bfloat16())
        q, zeros, scales = packing.quantize_4bit(w, 128)
        gptq = (*packing.pack_gptq(q, zeros, scales), None, 128)
        int4_w, int4pack_w = int4.prepare_weight(gptq), int4pack.prepare_weight(gptq)
        w_scale = (w.abs().amax(dim=0) / 448).reshape(n, 1)  # per output channel
        b8 = (w.T / w_scale).to(e4m3)  # [N, K]
        fp8_w = fp8.prepare_weight(b8)
        for m in args.m:
            x = torch.randn(m, k).bfloat16()
            x_scale = (x.float().abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)
            a8 = (x.float() / x_scale).to(e4m3)
            cells = [median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, dense, None, "none", [], ""), args.budget),
                     median_ms(lambda: int4pack.run(x, int4pack_w), args.budget)]
            for path in ("amx", "avx512_bf16"):
                if path == "amx" and isa != "amx":
                    cells.append(float("nan"))
                    continue
                int4.isa = path
                cells.append(median_ms(lambda: int4.run(x, int4_w), args.budget))
            int4.isa = isa
            slow = m * k * n > 64 * 4096 * 4096
            cells.append(float("nan") if slow else median_ms(lambda: fp8_ref(a8, b8, x_scale, w_scale, torch.bfloat16),
                                                             args.budget, max_calls=3))
            cells.append(median_ms(lambda: fp8(a8, fp8_w, x_scale, w_scale, torch.bfloat16), args.budget))
            print(f"| {k} x {n} | {m} | " + " | ".join("-" if c != c else f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
