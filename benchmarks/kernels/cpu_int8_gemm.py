"""Benchmark the cpu platform's W8A8 int8 GEMMs (``int8_scaled_gemm``) against each other and dense bf16.

    python benchmarks/kernels/cpu_int8_gemm.py                        # W1's shapes and 4096x4096, M 1..2048
    python benchmarks/kernels/cpu_int8_gemm.py --streamed -m 64       # weights from memory, as at decode

Kernels: ``torch_int_mm`` (quant_gemm.py, the old path), ``onednn_int8`` (onednn_int8_gemm.py) and
``cpu_native`` (native_int8.py, AMX), each on its prepared weight, per-token x scales, per-channel weight
scales, bfloat16 output; and the dense bf16 GEMM (``gemm``/onednn, prepacked) for scale. Those that decline
on this CPU are left out.

Hot (default): one weight, so it stays in L2 between calls. ``--streamed``: the call cycles through enough
copies of the weight (>= 96 MB) that each one comes from memory, like a decode step over a model's layers.
Time: per kernel, the median over ``--rounds`` rounds of the mean per call in the round; kernels alternate
within each round, each round after the machine is idle (noisy 2-core machines: other work moves timings)
and one untimed call of each (the first calls after an idle wait run slower).
"""
from __future__ import annotations

import argparse
import time


def busy_fraction(dt: float = 0.2) -> float:
    """Share of all CPUs busy over ``dt`` seconds (/proc/stat; 0 where there is none)."""
    def read():
        with open("/proc/stat") as f:
            v = list(map(int, f.readline().split()[1:]))
        return sum(v), v[3] + v[4]
    try:
        t0, i0 = read()
        time.sleep(dt)
        t1, i1 = read()
    except OSError:
        return 0.0
    return 1 - (i1 - i0) / max(1, t1 - t0)


def wait_idle(threshold: float = 0.15, max_wait_s: float = 300) -> None:
    start = time.time()
    while busy_fraction() > threshold and time.time() - start < max_wait_s:
        time.sleep(0.5)


def kernels(k: int, n: int, copies: int) -> dict:
    """name -> (call(m_inputs, copy), weights), for the kernels that run here."""
    import torch

    from halserve.kernels import resolve_kernel
    from halserve.platforms.cpu_kernels.native_int8 import NativeInt8ScaledGemm
    from halserve.platforms.cpu_kernels.onednn_int8_gemm import OneDnnInt8ScaledGemm
    from halserve.platforms.cpu_kernels.quant_gemm import CpuInt8ScaledGemm

    raw = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(copies)]
    scale_b = torch.rand(n, 1) * 1e-3
    out = {}
    for cls in (CpuInt8ScaledGemm, OneDnnInt8ScaledGemm, NativeInt8ScaledGemm):
        if cls.supports(dtype="int8", n=n, k=k) is None:
            kernel = cls()
            weights = [kernel.prepare_weight(w) for w in raw]
            out[cls.name] = lambda x, i, kernel=kernel, weights=weights: kernel(
                x["int8"], weights[i], x["scale"], scale_b, torch.bfloat16)
    dense = resolve_kernel("gemm", "cpu", dtype="bfloat16", n=n, k=k)
    dense_weights = [dense.prepare_weight(torch.randn(n, k, dtype=torch.bfloat16)) for _ in range(copies)]
    out["dense bf16"] = lambda x, i: dense(x["bf16"], dense_weights[i])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", type=int, nargs="+", default=[1, 16, 64, 256, 2048])
    p.add_argument("--shapes", nargs="+", default=["768x1280", "768x2304", "768x768", "768x4096", "2048x768",
                                                    "4096x4096"], help="KxN")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--streamed", action="store_true", help="cycle through >= 96 MB of weight copies")
    args = p.parse_args()

    import torch

    from halserve.platforms.cpu import keep_freed_memory

    keep_freed_memory()  # as the cpu platform does: large outputs reuse heap memory
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{'weights streamed from memory' if args.streamed else 'one weight (hot in cache)'}; ms per call")
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        copies = -(-(96 << 20) // (k * n)) if args.streamed else 1
        calls = kernels(k, n, copies)
        names = list(calls)
        print(f"\nK={k} N={n}" + (f" ({copies} copies)" if copies > 1 else ""))
        print(f"{'M':>5}  " + "".join(f"{name:>14}" for name in names) + "   speedup vs torch_int_mm")
        for m in args.m:
            x = {"int8": torch.randint(-127, 128, (m, k), dtype=torch.int8), "scale": torch.rand(m, 1) + 0.5,
                 "bf16": torch.randn(m, k, dtype=torch.bfloat16)}
            reps = max(copies, min(200, int(2e9 / max(1, m * k * n))))  # ~2 GMAC per kernel and round
            samples = {name: [] for name in names}
            with torch.no_grad():
                for fn in calls.values():
                    fn(x, 0)  # warm-up: primitive caches, page faults
                for _ in range(args.rounds):
                    wait_idle()
                    for fn in calls.values():
                        fn(x, 0)  # untimed: the cores back at speed after the idle wait
                    for name, fn in calls.items():
                        t0 = time.perf_counter()
                        for i in range(reps):
                            fn(x, i % copies)
                        samples[name].append((time.perf_counter() - t0) / reps * 1e3)
            ms = {name: sorted(v)[len(v) // 2] for name, v in samples.items()}
            base = ms.get("torch_int_mm")
            speedups = "  ".join(f"{name} {base / ms[name]:.2f}x" for name in names if base and name != "torch_int_mm")
            print(f"{m:>5}  " + "".join(f"{ms[name]:>14.3f}" for name in names) + f"   {speedups}")


if __name__ == "__main__":
    main()
