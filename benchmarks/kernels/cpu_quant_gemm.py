"""Benchmark the cpu platform's quantized GEMMs against dense float32 and the torch references.

    python benchmarks/kernels/cpu_quant_gemm.py                      # M in 1,16,256; three (K, N); 2 threads
    python benchmarks/kernels/cpu_quant_gemm.py -m 1 --shapes 4096x4096

Per shape and M: dense float32 (``gemm`` resolved on cpu: oneDNN, weight prepacked), the torch
references of gptq_gemm / awq_gemm (unpack and dequantize all of W to float32 on every call),
the cpu int4 kernels (``torch_int4pack``, prepared once), and the W8A8 GEMMs: int8 (reference vs
``torch_int_mm``) and fp8 (the reference, which is what cpu resolves; ``torch._scaled_mm`` with
row-wise scales shown for comparison, it is not registered). float32 activations, group size 128.

GB/s = bytes of the weight tensors the kernel is given (packed int4 + zeros + scales, or the
prepared layout; 4 B per fp32 weight, 1 B per int8/fp8 weight) / time per call. Time: median of
the calls that fit in ``--budget`` seconds (at least 2 after a warm-up call).
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable


def median_ms(fn: Callable[[], object], budget_s: float, max_calls: int = 50) -> float:
    t0 = time.perf_counter()
    fn()  # warm-up, and the estimate of how many calls fit the budget
    first = time.perf_counter() - t0
    calls = max(2, min(max_calls, int(budget_s / max(first, 1e-6))))
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return samples[len(samples) // 2] * 1e3


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def weights(k: int, n: int, group_size: int):
    """Every kernel's weight for one random [K, N] matrix, with its byte count."""
    import torch

    from halserve.kernels import packing, resolve_kernel
    from halserve.platforms.cpu_kernels.quant_gemm import CpuInt4AwqGemm, CpuInt4GptqGemm

    w = torch.randn(k, n) * 0.02  # [K, N]
    dense = resolve_kernel("gemm", "cpu", dtype="float32", n=n, k=k)
    q, zeros, scales = packing.quantize_4bit(w, group_size)
    gptq = packing.pack_gptq(q, zeros, scales)  # fp16 scales, as checkpoints
    awq = packing.pack_awq(q, zeros, scales)
    del q, zeros, scales
    gptq_prepared = CpuInt4GptqGemm().prepare_weight((*gptq, None, group_size))
    awq_prepared = CpuInt4AwqGemm().prepare_weight((*awq, group_size))
    fp8 = torch.float8_e4m3fn
    w8 = (w.T / w.abs().amax(dim=0)[:, None] * torch.finfo(fp8).max).to(fp8)  # [N, K]
    wi8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    return {
        "dense": (dense, dense.prepare_weight(w.T.contiguous()), 4 * k * n),
        "gptq": (gptq, nbytes(*gptq)),
        "awq": (awq, nbytes(*awq)),
        "gptq_prepared": (gptq_prepared, nbytes(gptq_prepared.packed, gptq_prepared.scales_and_zeros)),
        "awq_prepared": (awq_prepared, nbytes(awq_prepared.packed, awq_prepared.scales_and_zeros)),
        "fp8": (w8, torch.rand(n, 1) * 1e-3, k * n),
        "int8": (wi8, torch.rand(n, 1) * 1e-3, k * n),
    }


def cases(m: int, k: int, group_size: int, wts: dict) -> dict[str, tuple[Callable[[], object], int]]:
    import torch

    from halserve.kernels.reference import TorchAwqGemm, TorchFp8ScaledGemm, TorchGptqGemm, TorchInt8ScaledGemm
    from halserve.platforms.cpu_kernels.quant_gemm import CpuInt4AwqGemm, CpuInt4GptqGemm, CpuInt8ScaledGemm

    x = torch.randn(m, k)
    dense, dense_w, dense_bytes = wts["dense"]
    (qw, qz, s), gptq_bytes = wts["gptq"]
    (aqw, aqz, a_s), awq_bytes = wts["awq"]
    gptq_p, gptq_p_bytes = wts["gptq_prepared"]
    awq_p, awq_p_bytes = wts["awq_prepared"]
    w8, s8, fp8_bytes = wts["fp8"]
    wi8, si8, int8_bytes = wts["int8"]
    x8 = x.to(w8.dtype)
    sx = torch.rand(m, 1) + 0.5
    xi8 = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    ref_gptq, ref_awq, int4_gptq, int4_awq = TorchGptqGemm(), TorchAwqGemm(), CpuInt4GptqGemm(), CpuInt4AwqGemm()
    ref_fp8, ref_int8, int_mm = TorchFp8ScaledGemm(), TorchInt8ScaledGemm(), CpuInt8ScaledGemm()
    s8_row = s8.reshape(1, -1)
    f32 = torch.float32
    return {
        f"dense fp32 ({dense.name})": (lambda: dense(x, dense_w), dense_bytes),
        "gptq reference": (lambda: ref_gptq(x, qw, qz, s, None, group_size), gptq_bytes),
        "gptq torch_int4pack": (lambda: int4_gptq(x, gptq_p, qz, s, None, group_size), gptq_p_bytes),
        "awq reference": (lambda: ref_awq(x, aqw, aqz, a_s, group_size), awq_bytes),
        "awq torch_int4pack": (lambda: int4_awq(x, awq_p, aqz, a_s, group_size), awq_p_bytes),
        "int8 reference": (lambda: ref_int8(xi8, wi8, sx, si8, f32), int8_bytes),
        "int8 torch_int_mm": (lambda: int_mm(xi8, wi8, sx, si8, f32), int8_bytes),
        "fp8 reference": (lambda: ref_fp8(x8, w8, sx, s8, f32), fp8_bytes),
        "fp8 _scaled_mm rowwise (unused)": (
            lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=s8_row, out_dtype=f32), fp8_bytes),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--shapes", nargs="+", default=["4096x4096", "4096x11008", "2048x2048"], help="KxN")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget", type=float, default=0.4, help="seconds of timed calls per kernel and M")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads, float32 activations, group size {args.group_size}")
    start = time.perf_counter()
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        wts = weights(k, n, args.group_size)
        print(f"\nK={k} N={n}")
        print(f"{'M':>4}  {'kernel':<34}{'ms/call':>10}{'weight GB/s':>13}{'vs dense':>10}")
        for m in args.m:
            dense_ms = None
            for name, (fn, weight_bytes) in cases(m, k, args.group_size, wts).items():
                with torch.no_grad():
                    ms = median_ms(fn, args.budget)
                dense_ms = dense_ms or ms
                print(f"{m:>4}  {name:<34}{ms:>10.3f}{weight_bytes / ms / 1e6:>13.1f}{dense_ms / ms:>9.2f}x")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
