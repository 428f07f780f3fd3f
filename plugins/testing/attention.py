"""Attention conformance: every backend a plugin registers vs ``TorchAttentionBackend``.

Each scenario is a short sequence of engine-like steps over a few requests. Both the
backend and the reference get their own cache (each in its own ``kv_cache_shape``,
filled with random garbage first) and run every step through ``build_metadata`` and
``forward``, so a backend's cache is only ever written by the backend itself. Every
step's output is compared; the first step of a scenario is the "write phase" that fills
the prefixes later steps attend to.

    prefill_only       fresh prefills of several lengths (across block boundaries)
    decode_only        prefill, then two decode steps of every request
    prefix_hit_chunked request B shares request A's first two blocks (a prefix-cache hit)
                       and prefills the rest in two chunks
    mixed              decodes, a fresh prefill and a chunk after cached context, in one
                       step, in mixed order
    gqa / mqa          mixed with 8/2 and 4/1 query/KV heads (the base is 4/2)
    sliding_window     mixed with a window of 5 (if the backend declares it; a backend that claims
                       the sliding_window KV-cache kind and declines it fails)
    fp8_kv             mixed with an fp8 KV cache and k/v scales 0.5/0.25 (if declared)

Then every KV-cache spec kind the backend claims beyond these (``kv_cache_spec_kinds``: MLA, a
plugin's own kind) gets its own check (``spec_kind_checks.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from halserve.plugins.testing.results import ConformanceReport
from halserve.plugins.testing.spec_kind_checks import check_claimed_kinds, claimed_kinds
from halserve.plugins.testing.target import INTERPRETER_BF16_REASON, Target, TargetResolver

if TYPE_CHECKING:  # pragma: no cover
    from halserve.attention_backends.base import AttentionBackend

TOLERANCE = {"float32": 4e-4, "float16": 8e-3, "bfloat16": 6e-2}
FP8_KV_TOLERANCE = 3e-2
INTERPRETER_FP8_REASON = (
    "fp8 KV cache skipped under the Triton interpreter: its fp32->fp8 casts drop rounding carries "
    "(triton#8322), so cache writes are not exact; this case runs compiled on a GPU"
)
WINDOW = 5
FP8_SCALES = (0.5, 0.25)


@dataclass
class Scenario:
    name: str
    lengths: list[int]  # total positions of each request
    steps: list[list[tuple[int, int, int]]]  # per step: (request, first position, num tokens)
    shares: dict[int, tuple[int, int]] = field(default_factory=dict)  # req -> (req it shares with, num blocks)
    heads: tuple[int, int] = (4, 2)
    sliding_window: int | None = None
    kv_cache_dtype: str = "auto"


def scenarios(block: int, fp8_kv: str | None) -> list[Scenario]:
    b = block
    mixed_lengths = [b + 5, 7, 2 * b + 3, b + 9]
    mixed_steps = [
        [(0, 0, b + 3), (1, 0, 5), (3, 0, 6)],  # write phase, D's first chunk
        [(0, b + 3, 1), (2, 0, 2 * b + 3), (1, 5, 1), (3, 6, b + 3)],  # decode, prefill, decode, chunk
        [(1, 6, 1), (0, b + 4, 1)],
    ]
    out = [
        Scenario("prefill_only", [b + 3, 5, 2 * b + 1], [[(0, 0, b + 3), (1, 0, 5), (2, 0, 2 * b + 1)]]),
        Scenario("decode_only", [b + 4, 6, 2 * b + 2],
                 [[(0, 0, b + 2), (1, 0, 4), (2, 0, 2 * b)], [(0, b + 2, 1), (1, 4, 1), (2, 2 * b, 1)],
                  [(2, 2 * b + 1, 1), (0, b + 3, 1), (1, 5, 1)]]),
        Scenario("prefix_hit_chunked", [2 * b + 5, 3 * b + 2],
                 [[(0, 0, 2 * b + 5)], [(1, 2 * b, 5)], [(1, 2 * b + 5, b - 3)]], shares={1: (0, 2)}),
        Scenario("mixed", mixed_lengths, mixed_steps),
        Scenario("gqa", mixed_lengths, mixed_steps, heads=(8, 2)),
        Scenario("mqa", mixed_lengths, mixed_steps, heads=(4, 1)),
        Scenario("sliding_window", mixed_lengths, mixed_steps, sliding_window=WINDOW),
        Scenario("fp8_kv", mixed_lengths, mixed_steps, kv_cache_dtype=fp8_kv or "fp8"),
    ]
    return out


def _combos(cls: type[AttentionBackend], quick: bool, interpreter: bool) -> list[tuple[str, int, int]]:
    """(dtype, head size, block size) triples, zipped rather than crossed."""
    declared = [d for d in ("float32", "float16", "bfloat16") if d in cls.dtypes]
    if interpreter:
        declared = [d for d in declared if d != "bfloat16"] or declared
    dtypes = declared or ["float32"]
    heads = sorted(cls.head_sizes)[:2] if cls.head_sizes else [32, 64]
    blocks = sorted(cls.block_sizes)[:2] if cls.block_sizes else [16, 8]
    if quick:
        return [(dtypes[0], heads[0], blocks[0])]
    n = max(len(dtypes), len(heads), len(blocks))
    return [(dtypes[i % len(dtypes)], heads[i % len(heads)], blocks[i % len(blocks)]) for i in range(n)]


def check_attention(report: ConformanceReport, manager: Any, resolver: TargetResolver, quick: bool) -> None:
    for reg in manager.attention_backends.by_plugin(report.plugin):
        cls = reg.obj
        target = resolver.target(cls)
        fp8_kv = next((d for d in ("fp8", "fp8_e4m3", "fp8_e5m2") if d in getattr(cls, "kv_cache_dtypes", ())), None)
        for dtype, head_size, block_size in _combos(cls, quick, target.interpreter):
            for sc in scenarios(block_size, fp8_kv):
                label = (f"{sc.name} {dtype} head_size={head_size} block_size={block_size} "
                         f"heads={sc.heads[0]}/{sc.heads[1]}")
                if sc.sliding_window:
                    label += f" window={sc.sliding_window}"
                if sc.kv_cache_dtype != "auto":
                    label += f" kv={sc.kv_cache_dtype}"
                _run_scenario(report, reg.name, cls, sc, dtype, head_size, block_size, target, label, resolver)
        check_claimed_kinds(report, reg.name, cls, target, quick, _fp8_platform(resolver, target))


def _run_scenario(report, subject, cls, sc: Scenario, dtype, head_size, block_size, target: Target, label,
                  resolver) -> None:
    query = dict(dtype=dtype, head_size=head_size, block_size=block_size, kv_cache_dtype=sc.kv_cache_dtype,
                 sliding_window=sc.sliding_window, num_heads=sc.heads[0], num_kv_heads=sc.heads[1])
    try:
        reason = cls.supports(**query)
    except Exception as exc:  # noqa: BLE001
        report.add("attention", subject, label, "failed", f"supports() raised {type(exc).__name__}: {exc}")
        return
    if reason is not None:
        if sc.sliding_window and "sliding_window" in claimed_kinds(cls) and "sliding window" in reason:
            report.add("attention", subject, label, "failed", f"attention backend {subject} claims the sliding_window "
                       f"KV-cache kind (kv_cache_spec_kinds) but declines a window of {sc.sliding_window}: {reason}")
            return
        report.add("attention", subject, label, "declined", f"backend declines: {reason}")
        return
    if not target.runnable:
        report.add("attention", subject, label, "declined", target.reason)
        return
    if target.interpreter and dtype == "bfloat16":
        report.add("attention", subject, label, "declined", INTERPRETER_BF16_REASON)
        return
    if target.interpreter and sc.kv_cache_dtype != "auto":
        report.add("attention", subject, label, "declined", INTERPRETER_FP8_REASON)
        return
    try:
        worst = run_and_compare(cls, sc, dtype, head_size, block_size, target, _fp8_platform(resolver, target))
    except _Mismatch as exc:
        report.add("attention", subject, label, "failed", f"attention backend {subject}, case {label}: {exc}")
        return
    except Exception as exc:  # noqa: BLE001 - a claimed configuration that raises is a failure
        report.add("attention", subject, label, "failed",
                   f"attention backend {subject}, case {label}: raised {type(exc).__name__}: {exc}")
        return
    report.add("attention", subject, label, "passed", worst)


def _fp8_platform(resolver: TargetResolver, target: Target) -> str | None:
    """The fp8 flavour the target platform allocates for "fp8" (e.g. float8_e4m3fnuz on MI300)."""
    if target.platform in resolver.manager.platforms:
        return resolver.manager.platforms[target.platform].obj.fp8_dtype
    return None


class _Mismatch(AssertionError):
    pass


def _cache_dtype(kv_cache_dtype: str, dtype, fp8_platform: str | None):
    import torch

    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    return getattr(torch, fp8_platform or "float8_e4m3fn")


def run_and_compare(cls, sc: Scenario, dtype_name: str, head_size: int, block_size: int, target: Target,
                    fp8_platform: str | None) -> str:
    """Run every step on ``cls`` and the reference; raise ``_Mismatch`` on the first bad step."""
    import torch

    from halserve.attention_backends.torch_ref import TorchAttentionBackend

    dtype = getattr(torch, dtype_name)
    device = target.device
    hq, hk = sc.heads
    g = torch.Generator().manual_seed(1234)
    # per request: q/k/v for every position; shared prefixes get the owner's K/V
    qs = [torch.randn(n, hq, head_size, generator=g).to(dtype) for n in sc.lengths]
    ks = [torch.randn(n, hk, head_size, generator=g).to(dtype) for n in sc.lengths]
    vs = [torch.randn(n, hk, head_size, generator=g).to(dtype) for n in sc.lengths]
    for r, (owner, num_shared) in sc.shares.items():
        upto = num_shared * block_size
        ks[r][:upto], vs[r][:upto] = ks[owner][:upto], vs[owner][:upto]
    tables, num_blocks = block_tables(sc, block_size, g)

    scale = 1.0 / math.sqrt(head_size)
    k_scale, v_scale = FP8_SCALES if sc.kv_cache_dtype != "auto" else (1.0, 1.0)
    kwargs = dict(num_heads=hq, head_size=head_size, scale=scale, num_kv_heads=hk,
                  sliding_window=sc.sliding_window, logits_soft_cap=None, kv_cache_dtype=sc.kv_cache_dtype)
    impls = {
        "backend": (cls, cls(**kwargs), device, _cache_dtype(sc.kv_cache_dtype, dtype, fp8_platform)),
        "reference": (TorchAttentionBackend, TorchAttentionBackend(**kwargs), "cpu",
                      _cache_dtype(sc.kv_cache_dtype, dtype, None)),
    }
    caches = {}
    for key, (klass, _impl, dev, cdtype) in impls.items():
        shape = klass.kv_cache_shape(num_blocks, block_size, hk, head_size)
        caches[key] = (torch.randn(shape, generator=g) * 3).to(cdtype).to(dev)  # garbage nobody may read

    tol = FP8_KV_TOLERANCE if sc.kv_cache_dtype != "auto" else TOLERANCE[dtype_name]
    worst_rel = 0.0
    for step_index, step in enumerate(sc.steps, start=1):
        q = torch.cat([qs[r][s : s + n] for r, s, n in step])
        k = torch.cat([ks[r][s : s + n] for r, s, n in step])
        v = torch.cat([vs[r][s : s + n] for r, s, n in step])
        starts = [0]
        for _r, _s, n in step:
            starts.append(starts[-1] + n)
        outs = {}
        for key, (klass, impl, dev, _cdtype) in impls.items():
            meta = klass.build_metadata(step_metadata(step, tables, block_size, dev))
            outs[key] = impl.forward(q.to(dev), k.to(dev), v.to(dev), caches[key], meta, k_scale, v_scale)
        rel = compare_step(outs["backend"], outs["reference"], step, starts, step_index, len(sc.steps), tol)
        worst_rel = max(worst_rel, rel)
    return f"{len(sc.steps)} steps, max |error| {worst_rel:.2e} of max |ref| (tolerance {tol:.0e})"


def block_tables(sc: Scenario, block_size: int, g: Any) -> tuple[list[list[int]], int]:
    """(each request's block ids, in a random order; the pool size with 3 spare blocks): a request
    sharing another's first blocks (``sc.shares``: a prefix-cache hit) gets the same ids for them."""
    import torch

    blocks_needed = [math.ceil(n / block_size) for n in sc.lengths]
    num_blocks = sum(blocks_needed) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables: list[list[int]] = []
    for r, nb in enumerate(blocks_needed):
        owner = sc.shares.get(r)
        shared = tables[owner[0]][: owner[1]] if owner else []
        tables.append(shared + [order.pop() for _ in range(nb - len(shared))])
    return tables, num_blocks


def step_metadata(step: list[tuple[int, int, int]], tables: list[list[int]], block_size: int, dev: Any) -> Any:
    """The common ``AttentionMetadata`` of one scenario step (request, first position, tokens), on ``dev``."""
    import torch

    from halserve.attention_backends.base import AttentionMetadata

    starts = [0]
    for _r, _s, n in step:
        starts.append(starts[-1] + n)
    seq_lens = [s + n for _r, s, n in step]
    table = torch.zeros(len(step), max(len(t) for t in tables), dtype=torch.int32)
    slots: list[int] = []
    for row, (r, s, n) in enumerate(step):
        table[row, : len(tables[r])] = torch.tensor(tables[r], dtype=torch.int32)
        slots += [tables[r][p // block_size] * block_size + p % block_size for p in range(s, s + n)]
    qsl = torch.tensor(starts, dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=starts[-1], num_reqs=len(step), max_query_len=max(n for *_x, n in step),
        max_seq_len=max(seq_lens), query_start_loc=qsl.to(dev), seq_lens=sl.to(dev),
        block_table=table.to(dev), slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev),
        query_start_loc_cpu=qsl, seq_lens_cpu=sl,
    )


def compare_step(got, want, step, starts: list[int], step_index: int, num_steps: int, tol: float) -> float:
    """Max |got - want| over max |want| of one step ([T, ...] outputs); ``_Mismatch`` past ``tol``."""
    import torch

    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        raise _Mismatch(f"step {step_index} returned {tuple(got.shape)} {got.dtype}, "
                        f"expected {tuple(want.shape)} {want.dtype}")
    diff = (got.detach().cpu().double() - want.cpu().double()).abs()  # [T, H, D]
    if not bool(torch.isfinite(diff).all()):
        bad = int((~torch.isfinite(diff)).flatten(1).any(1).nonzero()[0])
        raise _Mismatch(f"step {step_index} output has NaN/inf at {_where(step, starts, bad)}")
    ref_max = max(want.abs().max().item(), 1e-6)
    per_token = diff.flatten(1).amax(1)  # [T]
    err = per_token.max().item()
    rel = err / ref_max
    if rel > tol:
        t = int(per_token.argmax())
        raise _Mismatch(
            f"step {step_index} of {num_steps}: max |error| {err:.3g} = {rel:.2e} of max |ref| {ref_max:.3g} "
            f"> tolerance {tol:.0e}; worst at {_where(step, starts, t)}"
        )
    return rel


def _where(step, starts, token: int) -> str:
    for row, (r, s, n) in enumerate(step):
        if starts[row] <= token < starts[row + 1]:
            i = token - starts[row]
            kind = "decode" if n == 1 else ("prefill" if s == 0 else f"chunk after {s} cached tokens")
            return f"request {r} position {s + i} ({kind}, query_len {n}, seq_len {s + n})"
    return f"token {token}"
