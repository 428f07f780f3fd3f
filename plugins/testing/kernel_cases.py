"""Generated cases per op: a small deterministic grid of shapes and dtypes.

Each case carries the ``problem`` a kernel's ``supports(**problem)`` is asked about
(``dtype`` plus the op's ``problem_keys``), a builder of CPU inputs (seeded, so every
run sees the same numbers) and how the result is compared with the torch reference.
``quick`` trims each grid to a few cases that still cover every mode of the op.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# max |got - ref| allowed, relative to max |ref|, by the dtype results are rounded to
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}


@dataclass
class KernelCase:
    label: str  # "M=7 N=48 K=64 float16 bias"
    problem: dict[str, Any]  # what supports() is asked
    make: Callable[[], tuple[list[Any], dict[str, Any]]]  # CPU (args, kwargs), deterministic
    tol: float = 1e-4  # relative to max |ref| ("close" comparison)
    compare: str = "close"  # "close" | "int8_quant" | "fp8_quant"
    dtypes: tuple[str, ...] = field(default_factory=tuple)  # every float dtype involved (bf16 check)


def _gen(seed: int):
    import torch

    return torch.Generator().manual_seed(seed)


def _t(name: str):
    import torch

    return getattr(torch, name)


# -- dense and scaled GEMMs ---------------------------------------------------------------
def gemm_cases(quick: bool) -> list[KernelCase]:
    import torch

    dtypes = ("float32", "float16") if quick else ("float32", "float16", "bfloat16")
    ms = (1, 7) if quick else (1, 7, 33)
    nks = ((48, 64),) if quick else ((16, 16), (48, 64), (64, 48))
    cases = []
    i = 0
    for dtype in dtypes:
        for m in ms:
            for n, k in nks:
                bias = i % 2 == 1
                i += 1

                def make(m=m, n=n, k=k, dtype=dtype, bias=bias, seed=i):
                    g = _gen(seed)
                    x = torch.randn(m, k, generator=g).to(_t(dtype))
                    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(_t(dtype))
                    b = (0.1 * torch.randn(n, generator=g)).to(_t(dtype)) if bias else None
                    return [x, w, b], {}

                cases.append(KernelCase(f"M={m} N={n} K={k} {dtype}{' bias' if bias else ''}",
                                        {"dtype": dtype, "n": n, "k": k}, make, TOLERANCE[dtype], dtypes=(dtype,)))
    return cases


def _scales(g, m: int, n: int, per_token: bool, small: bool):
    import torch

    if per_token:  # per-token activations x per-channel weights
        lo = 0.005 if small else 0.5
        return torch.rand(m, 1, generator=g) * lo + lo, torch.rand(n, 1, generator=g) * lo + lo
    return (torch.tensor([0.01]), torch.tensor([0.02])) if small else (torch.tensor([0.7]), torch.tensor([1.3]))


def fp8_gemm_cases(quick: bool) -> list[KernelCase]:
    import torch

    # (fp8 dtype, per-token scales?, out dtype, M, bias)
    grid = [
        ("float8_e4m3fn", True, "float32", 7, True),
        ("float8_e4m3fn", False, "float16", 1, False),
        ("float8_e4m3fnuz", True, "float32", 7, False),
        ("float8_e5m2", False, "float32", 33, True),
        ("float8_e4m3fn", True, "bfloat16", 33, True),
        ("float8_e4m3fnuz", False, "float16", 33, True),
    ]
    if quick:
        grid = grid[:4]
    n, k = 48, 64
    cases = []
    for i, (fp8, per_token, out, m, bias) in enumerate(grid):

        def make(fp8=fp8, per_token=per_token, out=out, m=m, bias=bias, seed=100 + i):
            g = _gen(seed)
            a = (torch.randn(m, k, generator=g) * 4).to(_t(fp8))
            b = (torch.randn(n, k, generator=g) * 4).to(_t(fp8))
            sa, sb = _scales(g, m, n, per_token, small=False)
            bias_t = torch.randn(n, generator=g).to(_t(out)) if bias else None
            return [a, b, sa, sb, _t(out)], {"bias": bias_t}

        scales = "per-token x per-channel scales" if per_token else "per-tensor scales"
        cases.append(KernelCase(f"M={m} N={n} K={k} {fp8} {scales} -> {out}{' bias' if bias else ''}",
                                {"dtype": fp8, "fp8_dtype": fp8, "n": n, "k": k}, make, 2 * TOLERANCE[out],
                                dtypes=(out, fp8)))
    return cases


def fp8_block_gemm_cases(quick: bool) -> list[KernelCase]:
    import torch

    # (fp8 dtype, block (Bn, Bk), out dtype, M, N, K, bias): N and K not multiples of the block
    grid = [
        ("float8_e4m3fn", (32, 32), "float32", 7, 48, 80, True),
        ("float8_e4m3fn", (128, 128), "float16", 1, 136, 200, False),
        ("float8_e5m2", (16, 64), "float32", 33, 40, 72, True),
        ("float8_e4m3fnuz", (32, 32), "float32", 7, 48, 80, False),
        ("float8_e4m3fn", (128, 128), "bfloat16", 33, 136, 200, True),
    ]
    if quick:
        grid = grid[:3]
    cases = []
    for i, (fp8, block, out, m, n, k, bias) in enumerate(grid):

        def make(fp8=fp8, block=block, out=out, m=m, n=n, k=k, bias=bias, seed=1000 + i):
            g = _gen(seed)
            a = (torch.randn(m, k, generator=g) * 4).to(_t(fp8))
            b = (torch.randn(n, k, generator=g) * 4).to(_t(fp8))
            sa = torch.rand(m, -(-k // block[1]), generator=g) + 0.5  # per token per Bk features
            sb = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) + 0.5  # per Bn x Bk block
            bias_t = torch.randn(n, generator=g).to(_t(out)) if bias else None
            return [a, b, sa, sb, block, _t(out)], {"bias": bias_t}

        label = f"M={m} N={n} K={k} {fp8} {block[0]}x{block[1]} blocks -> {out}{' bias' if bias else ''}"
        cases.append(KernelCase(label, {"dtype": fp8, "fp8_dtype": fp8, "n": n, "k": k, "block_size": block}, make,
                                2 * TOLERANCE[out], dtypes=(out, fp8)))
    return cases


def group_fp8_quant_cases(quick: bool) -> list[KernelCase]:
    import torch

    # (activation dtype, fp8 dtype, group size): K = 300 leaves a partial last group
    grid = [
        ("float32", "float8_e4m3fn", 128),
        ("float16", "float8_e4m3fn", 64),
        ("float32", "float8_e5m2", 48),
        ("float32", "float8_e4m3fnuz", 128),
        ("bfloat16", "float8_e4m3fn", 128),
    ]
    if quick:
        grid = grid[:3]
    m, k = (5, 200) if quick else (7, 300)
    cases = []
    for i, (dtype, fp8, group) in enumerate(grid):

        def make(dtype=dtype, fp8=fp8, group=group, seed=1100 + i):
            g = _gen(seed)
            return [(torch.randn(m, k, generator=g) * 2).to(_t(dtype)), fp8, group], {}

        cases.append(KernelCase(f"[{m},{k}] {dtype} -> {fp8} groups of {group}",
                                {"dtype": dtype, "fp8_dtype": fp8, "group_size": group}, make,
                                compare="fp8_quant", dtypes=(dtype, fp8)))
    return cases


def int8_gemm_cases(quick: bool) -> list[KernelCase]:
    import torch

    grid = [(True, True, "float32", 7), (False, False, "float16", 1), (True, False, "bfloat16", 33)]
    if quick:
        grid = grid[:2]
    n, k = 48, 80
    cases = []
    for i, (per_token, bias, out, m) in enumerate(grid):

        def make(per_token=per_token, bias=bias, out=out, m=m, seed=200 + i):
            g = _gen(seed)
            a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
            b = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
            sa, sb = _scales(g, m, n, per_token, small=True)
            bias_t = torch.randn(n, generator=g).to(_t(out)) if bias else None
            return [a, b, sa, sb, _t(out)], {"bias": bias_t}

        scales = "per-token x per-channel scales" if per_token else "per-tensor scales"
        cases.append(KernelCase(f"M={m} N={n} K={k} int8 {scales} -> {out}{' bias' if bias else ''}",
                                {"dtype": "int8", "n": n, "k": k}, make, 2 * TOLERANCE[out], dtypes=(out,)))
    return cases


# -- activation quantization ---------------------------------------------------------------
def fp8_quant_cases(quick: bool) -> list[KernelCase]:
    import torch

    # (activation dtype, fp8 dtype, mode)
    grid = [
        ("float32", "float8_e4m3fn", "dynamic per-token"),
        ("float16", "float8_e4m3fn", "static"),
        ("float32", "float8_e5m2", "dynamic per-tensor"),
        ("float32", "float8_e4m3fnuz", "dynamic per-token"),
        ("bfloat16", "float8_e4m3fn", "dynamic per-tensor"),
    ]
    if quick:
        grid = grid[:4]
    m, k = (5, 64) if quick else (7, 300)
    cases = []
    for i, (dtype, fp8, mode) in enumerate(grid):

        def make(dtype=dtype, fp8=fp8, mode=mode, seed=300 + i):
            g = _gen(seed)
            x = (torch.randn(m, k, generator=g) * 2).to(_t(dtype))
            scale = torch.tensor([0.02]) if mode == "static" else None
            return [x, fp8, scale, mode == "dynamic per-token"], {}

        cases.append(KernelCase(f"[{m},{k}] {dtype} -> {fp8} {mode}", {"dtype": dtype, "fp8_dtype": fp8}, make,
                                compare="fp8_quant", dtypes=(dtype, fp8)))
    return cases


def int8_quant_cases(quick: bool) -> list[KernelCase]:
    import torch

    grid = [("float32", "dynamic per-token"), ("float16", "static"), ("bfloat16", "dynamic per-token")]
    if quick:
        grid = grid[:2]
    m, k = (5, 64) if quick else (6, 1100)
    cases = []
    for i, (dtype, mode) in enumerate(grid):

        def make(dtype=dtype, mode=mode, seed=400 + i):
            g = _gen(seed)
            x = (torch.randn(m, k, generator=g) * 3).to(_t(dtype))
            return [x, torch.tensor([0.05]) if mode == "static" else None], {}

        cases.append(KernelCase(f"[{m},{k}] {dtype} -> int8 {mode}", {"dtype": dtype}, make, compare="int8_quant",
                                dtypes=(dtype,)))
    return cases


# -- 4-bit weight-only GEMMs (AutoAWQ / GPTQ v1 packing) ----------------------------------
def _wo4_grid(quick: bool) -> list[tuple[str, int, int, int, bool]]:
    # (dtype, K, group size, M, act-order g_idx); 128 only where K allows it
    grid = [("float32", 256, 128, 3, False), ("float16", 256, -1, 7, False), ("float16", 256, 128, 4, True),
            ("float32", 64, -1, 17, False), ("bfloat16", 256, 128, 1, False)]
    return grid[:3] if quick else grid


def awq_cases(quick: bool) -> list[KernelCase]:
    return _wo4_cases("awq", quick)


def gptq_cases(quick: bool) -> list[KernelCase]:
    return _wo4_cases("gptq", quick)


def _wo4_cases(fmt: str, quick: bool) -> list[KernelCase]:
    import torch

    from halserve.kernels import packing

    n = 48  # a multiple of 8 (packing) and of 16 (CPU int4 kernels), of no GPU tile
    cases = []
    for i, (dtype, k, group, m, act_order) in enumerate(_wo4_grid(quick)):
        if fmt == "awq" and act_order:
            continue  # AWQ has no g_idx

        def make(dtype=dtype, k=k, group=group, m=m, act_order=act_order, seed=500 + i):
            g = _gen(seed)
            q, zeros, scales = packing.quantize_4bit(torch.randn(k, n, generator=g), group)
            x = torch.randn(m, k, generator=g).to(_t(dtype))
            if fmt == "awq":
                qw, qz, s = packing.pack_awq(q, zeros, scales, dtype=_t(dtype))
                return [x, qw, qz, s, group], {}
            qw, qz, s = packing.pack_gptq(q, zeros, scales, dtype=_t(dtype))
            g_idx = None
            if act_order:  # desc_act: row k belongs to group g_idx[k], a permutation of k // G
                g_idx = (torch.arange(k) // packing.group_rows(k, group))[torch.randperm(k, generator=g)]
                g_idx = g_idx.to(torch.int32)
            return [x, qw, qz, s, g_idx, group], {}

        label = f"M={m} N={n} K={k} {dtype} group_size={group}{' act-order g_idx' if act_order else ''}"
        cases.append(KernelCase(label, {"dtype": dtype, "n": n, "k": k, "group_size": group}, make,
                                2 * TOLERANCE[dtype], dtypes=(dtype,)))
    return cases


def gguf_cases(quick: bool) -> list[KernelCase]:
    """GGUF blocks of every type (random, valid: ``gguf_blocks.random_blocks``). Tolerance 3e-2: a kernel may
    quantize the activations to 8 bits per block of 32 as llama.cpp does (the CPU's native one does)."""
    import torch

    from halserve.kernels.gguf_blocks import GGUF_BLOCKS, random_blocks

    cases = []
    for i, qtype in enumerate(GGUF_BLOCKS):
        k = GGUF_BLOCKS[qtype][0] * 2
        for m, n, dtype, bias in ((1, 40, "float32", False), (7, 33, "bfloat16", True))[: 1 if quick else 2]:

            def make(qtype=qtype, m=m, n=n, k=k, dtype=dtype, bias=bias, seed=700 + i):
                g = _gen(seed)
                x = torch.randn(m, k, generator=g).to(_t(dtype))
                b = (0.1 * torch.randn(n, generator=g)).to(_t(dtype)) if bias else None
                return [x, random_blocks(qtype, n, k, g), qtype, b], {}

            cases.append(KernelCase(f"M={m} N={n} K={k} {qtype} {dtype}{' bias' if bias else ''}",
                                    {"dtype": dtype, "n": n, "k": k, "qtype": qtype}, make, 3e-2, dtypes=(dtype,)))
    return cases


# -- elementwise and normalization ---------------------------------------------------------
def rms_norm_cases(quick: bool) -> list[KernelCase]:
    import torch

    grid = [("float32", 7, 96, True), ("float32", 1, 64, False), ("float16", 7, 96, False), ("float16", 7, 64, True),
            ("bfloat16", 7, 96, True)]
    if quick:
        grid = grid[:3]
    cases = []
    for i, (dtype, t, h, residual) in enumerate(grid):

        def make(dtype=dtype, t=t, h=h, residual=residual, seed=600 + i):
            g = _gen(seed)
            x = torch.randn(t, h, generator=g).to(_t(dtype))
            w = (torch.rand(h, generator=g) + 0.5).to(_t(dtype))
            res = torch.randn(t, h, generator=g).to(_t(dtype)) if residual else None
            return [x, w, 1e-6, res], {}

        cases.append(KernelCase(f"T={t} H={h} {dtype} {'with' if residual else 'without'} residual",
                                {"dtype": dtype, "hidden_size": h}, make, 2 * TOLERANCE[dtype], dtypes=(dtype,)))
    return cases


def rotary_cases(quick: bool) -> list[KernelCase]:
    import torch

    # (dtype, neox?, head size, rotary dim): gpt-j style and partial rotary included
    grid = [("float32", True, 64, 64), ("float32", False, 64, 64), ("float32", True, 80, 32),
            ("float16", False, 96, 48), ("bfloat16", True, 64, 64)]
    if quick:
        grid = grid[:3]
    num_tokens, hq, hk, max_pos = 5, 4, 2, 32
    cases = []
    for i, (dtype, neox, d, r) in enumerate(grid):

        def make(dtype=dtype, neox=neox, d=d, r=r, seed=700 + i):
            g = _gen(seed)
            inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
            freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)  # [P, R/2]
            cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(_t(dtype))  # [P, R]
            positions = torch.tensor([0, 3, 31, 7, 7])
            q = torch.randn(num_tokens, hq * d, generator=g).to(_t(dtype))
            k = torch.randn(num_tokens, hk * d, generator=g).to(_t(dtype))
            return [positions, q, k, cos_sin, d, neox], {}

        style = "neox" if neox else "gpt-j"
        partial = f" partial rotary_dim={r}" if r < d else ""
        cases.append(KernelCase(f"T={num_tokens} heads={hq}/{hk} head_size={d} {style}{partial} {dtype}",
                                {"dtype": dtype, "head_size": d, "rotary_dim": r, "is_neox": neox}, make,
                                2 * TOLERANCE[dtype], dtypes=(dtype,)))
    return cases


def silu_and_mul_cases(quick: bool) -> list[KernelCase]:
    import torch

    grid = [("float32", 3, 64), ("float16", 3, 1500), ("float32", 1, 1500), ("bfloat16", 3, 64)]
    if quick:
        grid = grid[:2]
    cases = []
    for i, (dtype, t, inter) in enumerate(grid):

        def make(dtype=dtype, t=t, inter=inter, seed=800 + i):
            return [torch.randn(t, 2 * inter, generator=_gen(seed)).to(_t(dtype))], {}

        cases.append(KernelCase(f"T={t} I={inter} {dtype}", {"dtype": dtype, "intermediate_size": inter}, make,
                                2 * TOLERANCE[dtype], dtypes=(dtype,)))
    return cases


def fused_moe_cases(quick: bool) -> list[KernelCase]:
    import torch

    # (dtype, tokens, experts, top-k, hidden, intermediate): 3 tokens x top-2 leave most of 8 experts idle
    grid = [("float32", 3, 8, 2, 64, 32), ("float16", 9, 4, 2, 64, 48), ("float32", 1, 4, 1, 32, 16),
            ("bfloat16", 9, 6, 3, 64, 32)]
    if quick:
        grid = grid[:2]
    cases = []
    for i, (dtype, t, e, k, h, inter) in enumerate(grid):

        def make(dtype=dtype, t=t, e=e, k=k, h=h, inter=inter, seed=900 + i):
            g = _gen(seed)
            hidden = torch.randn(t, h, generator=g).to(_t(dtype))
            w13 = (torch.randn(e, 2 * inter, h, generator=g) / math.sqrt(h)).to(_t(dtype))
            w2 = (torch.randn(e, h, inter, generator=g) / math.sqrt(inter)).to(_t(dtype))
            topk_weights, topk_ids = torch.rand(t, e, generator=g).softmax(-1).topk(k, dim=-1)
            return [hidden, w13, w2, topk_weights, topk_ids], {}

        cases.append(KernelCase(f"T={t} E={e} top_k={k} H={h} I={inter} {dtype}",
                                {"dtype": dtype, "num_experts": e, "top_k": k, "hidden_size": h,
                                 "intermediate_size": inter}, make, 2 * TOLERANCE[dtype], dtypes=(dtype,)))
    return cases


CASES: dict[str, Callable[[bool], list[KernelCase]]] = {
    "gemm": gemm_cases,
    "fp8_scaled_gemm": fp8_gemm_cases,
    "int8_scaled_gemm": int8_gemm_cases,
    "scaled_fp8_quant": fp8_quant_cases,
    "scaled_int8_quant": int8_quant_cases,
    "awq_gemm": awq_cases,
    "gptq_gemm": gptq_cases,
    "gguf_gemm": gguf_cases,
    "rms_norm": rms_norm_cases,
    "rotary_embedding": rotary_cases,
    "silu_and_mul": silu_and_mul_cases,
    "fused_moe": fused_moe_cases,
    "gelu_tanh_and_mul": silu_and_mul_cases,  # the same gated [T, 2I] -> [T, I] inputs and problem keys
    "per_token_group_fp8_quant": group_fp8_quant_cases,
    "fp8_block_scaled_gemm": fp8_block_gemm_cases,
}
