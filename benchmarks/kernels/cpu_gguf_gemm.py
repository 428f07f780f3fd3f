"""GGUF kernels on the CPU: the native gguf_gemm (int8 activations, integer dot products) against the float
GEMM the dequantized model runs, on SmolLM2-135M's linear shapes; and single-stream decode of the real model.

    python benchmarks/kernels/cpu_gguf_gemm.py kernels [--rows 1]
    python benchmarks/kernels/cpu_gguf_gemm.py decode --model ~/.cache/halserve/models/SmolLM2-135M-Instruct.Q4_1.gguf
    python benchmarks/kernels/cpu_gguf_gemm.py paths --rows 1,4,16,32,64,512 --qtype Q4_0 [--isa avx2]
    python benchmarks/kernels/cpu_gguf_gemm.py model --rows 1,16,64 --qtype Q4_0 [--head-qtype Q8_0] [--isa avx2]
        [--levels 1|2] [--no-head]

``paths``: one layer's four GEMMs (microseconds, summed) at each row count M, the previous paths (``gguf_gemv``
on the GGUF rows below 32 rows, one int8 level below 16 and two from 16; the float32 panel dequantized per call
from 32) against today's kernel call (the repacked integer path, same levels; AVX2's panel from 128 rows),
timed alternately shape by shape (``--head``: SmolLM2's LM head, two levels at every M as halserve.layers.vocab
asks, and before from 32 rows its cached float32 panel, 113 MB). The previous paths run with today's AVX2 activation quantizer (it was
scalar), so they read a little faster than they were.

``model``: the GEMMs of one whole SmolLM2-135M forward at M rows (30 layers' four, each layer its own weights,
then the LM head, two levels as halserve.layers.vocab asks), so the weights stream from memory as in a decode
step (115 MB of repacked Q4_0 would not stay in any cache); milliseconds per pass (median of rounds) and the
repacked bytes read per pass over that time (GB/s), beside a plain ``torch.sum`` read of 512 MB for scale.

``kernels``: microseconds per call (median of rounds), each shape's weight streamed as in a decode step
(all four shapes' weights cycled so the caches do not hold them). ``decode``: 128 prompt tokens, 128
generated, greedy, one stream, offline ``LLM``: gguf (the default, quantized kernels) vs
``--quantization unquantized`` in float32 and bfloat16. Decode tok/s = 127 / (time for 128 tokens - time
for 1 token); end to end = 128 / time for 128.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

# SmolLM2-135M: (name, N, K) of its linear layers (qkv fused: 576 + 192 + 192)
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]


def _time_us(fn, iters: int = 200, rounds: int = 7) -> float:
    fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(samples)


def bench_kernels(rows: int, qtype: str, copies: int) -> None:
    from halserve.kernels import resolve_kernel
    from halserve.kernels.gguf_blocks import dequantize, random_blocks
    from halserve.platforms.cpu_kernels.native_gguf import ISA_CODES, NativeGgufGemm, load_gguf_ops

    assert load_gguf_ops() is None, load_gguf_ops()
    g = torch.Generator().manual_seed(0)
    isas = [isa for isa in ISA_CODES if torch.ops.halserve_cpu_gguf.gguf_isa_supported(ISA_CODES[isa])]
    print(f"M={rows} {qtype}, {torch.get_num_threads()} threads; microseconds per call")
    print(f"{'layer':8} {'N x K':>11} " + " ".join(f"{'gguf ' + i:>16}" for i in isas)
          + f" {'float32 gemm':>13} {'bf16 gemm':>10}")
    for name, n, k in SHAPES:
        ws = [random_blocks(qtype, n, k, g) for _ in range(copies)]
        x = torch.randn(rows, k, generator=g)
        cols = []
        for isa in isas:
            kernel, i = NativeGgufGemm(isa), [0]

            def call(kernel=kernel, i=i):
                i[0] = (i[0] + 1) % copies
                kernel(x, ws[i[0]], qtype)

            cols.append(_time_us(call))
        for dtype in (torch.float32, torch.bfloat16):
            gemm = resolve_kernel("gemm", "cpu", dtype=str(dtype).replace("torch.", ""), n=n, k=k)
            dense = [gemm.prepare_weight(dequantize(w, qtype, k).to(dtype)) for w in ws]
            xd, i = x.to(dtype), [0]

            def call(gemm=gemm, dense=dense, xd=xd, i=i):
                i[0] = (i[0] + 1) % copies
                gemm(xd, dense[i[0]], None)

            cols.append(_time_us(call))
        print(f"{name:8} {f'{n} x {k}':>11} " + " ".join(f"{c:16.1f}" for c in cols[:len(isas)])
              + f" {cols[-2]:13.1f} {cols[-1]:10.1f}")


def bench_paths(rows: list[int], qtype: str, isa: str | None, copies: int, head: bool = False) -> None:
    import torch.nn.functional as F

    from halserve.kernels.gguf_blocks import random_blocks
    from halserve.platforms.cpu_kernels.native_gguf import PANEL_BYTES, QTYPE_CODES, NativeGgufGemm

    kernel = NativeGgufGemm(isa)
    code, isa_code = QTYPE_CODES[qtype], kernel.isa_code
    g = torch.Generator().manual_seed(0)
    shapes = [(name, n, k) for name, n, k in SHAPES if qtype not in ("Q4_K", "Q5_K", "Q6_K") or k % 256 == 0]
    panels = {}
    if head:  # the LM head as halserve.layers.vocab sets it: two levels always; before, a cached float panel
        shapes, copies = [("lm_head", 49152, 576)], 1
        kernel.min_activation_levels = 2
    weights = {name: [random_blocks(qtype, n, k, g) for _ in range(copies)] for name, n, k in shapes}

    def previous(x, w, k):  # native_gguf.py's __call__ before the repacked path
        m = x.shape[0]
        if m < 32:
            return kernel.ops.gguf_gemv(x, w, code, isa_code, 2 if head or m >= 16 else 1)
        if head:
            if id(w) not in panels:
                panels[id(w)] = kernel.dequantize(w, qtype, k)
            return F.linear(x, panels[id(w)])
        n, rows = w.shape[0], max(1, PANEL_BYTES // (4 * k))
        out = torch.empty(m, n)
        for n0 in range(0, n, rows):
            out[:, n0:n0 + rows] = F.linear(x, kernel.dequantize(w[n0:n0 + rows], qtype, k))
        return out

    print(f"{qtype}, {kernel.isa}, {torch.get_num_threads()} threads; {'the LM head' if head else 'one layer'}'s GEMMs "
          f"({', '.join(name for name, _, _ in shapes)}), microseconds per call, summed")
    print(f"{'M':>5} {'previous':>10} {'now':>10} {'speedup':>8} {'now us/row':>11}")
    for m in rows:
        iters = max(3, 1500 // m)
        old = new = 0.0
        for name, _n, k in shapes:
            ws, x, i = weights[name], torch.randn(m, k, generator=g), [0]
            for w in ws:
                kernel(x, w, qtype)  # the repacked copies made before timing

            def run_old(ws=ws, x=x, k=k, i=i):
                i[0] = (i[0] + 1) % copies
                previous(x, ws[i[0]], k)

            def run_new(ws=ws, x=x, i=i):
                i[0] = (i[0] + 1) % copies
                kernel(x, ws[i[0]], qtype)

            old += _time_us(run_old, iters, 5)
            new += _time_us(run_new, iters, 5)
        print(f"{m:5d} {old:10.0f} {new:10.0f} {old / new:7.2f}x {new / m:11.1f}", flush=True)


def bench_model(rows: list[int], qtype: str, head_qtype: str, isa: str | None, layers: int = 30,
                levels: int | None = None, head: bool = True) -> None:
    from halserve.kernels.gguf_blocks import random_blocks
    from halserve.platforms.cpu_kernels.native_gguf import _PACKED_ATTR, NativeGgufGemm

    kernel, head_kernel = NativeGgufGemm(isa), NativeGgufGemm(isa)
    head_kernel.min_activation_levels = 2
    if levels is not None:  # the layers' levels at every M (default: one below TWO_LEVEL_MIN_ROWS rows, else two)
        kernel.forced_levels = levels
    g = torch.Generator().manual_seed(0)
    weights = [(kernel, random_blocks(qtype, n, k, g), qtype, k) for _ in range(layers) for _name, n, k in SHAPES]
    if head:
        weights.append((head_kernel, random_blocks(head_qtype, 49152, 576, g), head_qtype, 576))
    for kern, w, qt, k in weights:
        kern(torch.randn(1, k, generator=g), w, qt)  # the repacked copies made before timing
    packed = sum(getattr(w, _PACKED_ATTR)[1].numel() for _k, w, _q, _kk in weights)
    gguf = sum(w.numel() for _k, w, _q, _kk in weights)
    big = torch.ones(128 << 20)
    big.sum()
    start = time.perf_counter()
    for _ in range(5):
        big.sum()
    read_gbs = 5 * big.numel() * 4 / (time.perf_counter() - start) / 1e9
    print(f"{layers} layers {qtype}" + (f" + head {head_qtype}" if head else "") + f", levels {levels or 'auto'}, {kernel.isa}, {torch.get_num_threads()} threads; GGUF bytes "
          f"{gguf / 1e6:.1f} MB, repacked {packed / 1e6:.1f} MB; torch.sum reads {read_gbs:.1f} GB/s")
    print(f"{'M':>5} {'ms/pass':>8} {'repacked GB/s':>14} {'ms/pass/row':>12}")
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}

        def one_pass():
            for kern, w, qt, k in weights:
                kern(xs[k], w, qt)

        ms = _time_us(one_pass, iters=max(2, 40 // m), rounds=5) / 1e3
        print(f"{m:5d} {ms:8.2f} {packed / ms / 1e6:14.1f} {ms / m:12.3f}", flush=True)


def bench_decode(model: str, modes: list[str]) -> None:
    from halserve import LLM, SamplingParams

    prompt = {"prompt_token_ids": [(7 * i + 13) % 40000 + 100 for i in range(128)]}
    print(f"{model}: 128 prompt tokens, 128 generated, greedy, one stream")
    for mode in modes:
        quant, dtype = mode.split("/")
        kwargs = {} if quant == "gguf" else {"quantization": "unquantized"}
        llm = LLM(model, platform="cpu", dtype=dtype, max_model_len=512, num_kv_blocks=64, **kwargs)
        try:
            def run(n: int) -> float:
                params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                start = time.perf_counter()
                llm.generate([prompt], params, use_tqdm=False)
                return time.perf_counter() - start

            run(128)  # warm up
            t1 = statistics.median(run(1) for _ in range(3))
            t128 = statistics.median(run(128) for _ in range(3))
            print(f"{mode:18} decode {127 / (t128 - t1):6.1f} tok/s   end to end {128 / t128:6.1f} tok/s   "
                  f"(prefill+1 {t1 * 1e3:.0f} ms, 128 tokens {t128:.2f} s)", flush=True)
        finally:
            llm.llm_engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["kernels", "decode", "paths", "model"])
    parser.add_argument("--rows", default="1", help="activation rows M (kernels; paths: comma-separated)")
    parser.add_argument("--isa", default=None, help="avx2 or avx512_vnni (paths; default: the best here)")
    parser.add_argument("--head", action="store_true", help="paths: SmolLM2's 49152 x 576 LM head instead")
    parser.add_argument("--qtype", default="Q4_1", help="GGUF type (kernels)")
    parser.add_argument("--head-qtype", default="Q8_0", help="the LM head's GGUF type (model)")
    parser.add_argument("--levels", type=int, choices=(1, 2), default=None,
                        help="model: the layers' int8 levels at every M (default: the kernel's rule)")
    parser.add_argument("--no-head", action="store_true", help="model: the 30 layers only")
    parser.add_argument("--copies", type=int, default=8, help="weights cycled per shape (kernels)")
    parser.add_argument("--model", help="the .gguf (decode)")
    parser.add_argument("--modes", default="gguf/float32,unquantized/float32,unquantized/bfloat16")
    args = parser.parse_args()
    if args.what == "kernels":
        bench_kernels(int(args.rows), args.qtype, args.copies)
    elif args.what == "paths":
        bench_paths([int(r) for r in args.rows.split(",")], args.qtype, args.isa, args.copies, args.head)
    elif args.what == "model":
        bench_model([int(r) for r in args.rows.split(",")], args.qtype, args.head_qtype, args.isa,
                    levels=args.levels, head=not args.no_head)
    else:
        bench_decode(args.model, args.modes.split(","))


if __name__ == "__main__":
    main()
