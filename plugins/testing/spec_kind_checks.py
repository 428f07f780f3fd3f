"""The KV-cache spec kinds an attention backend claims (``kv_cache_spec_kinds``), each checked.

    full_attention     the attention scenarios (attention.py)
    sliding_window     its windowed scenario; declining a window is then a failure, not a decline
    mla                ``forward_mla`` vs ``TorchAttentionBackend.forward_mla`` over the prefill_only,
                       decode_only, prefix_hit_chunked and mixed steps (and fp8 latent pages with
                       k_scale 0.5 when the backend declares an fp8 cache): 4 heads, latent rank 32,
                       rotary 8, nope 16, values 16; each backend writes its own latent cache
    a plugin's kind    the check its plugin registered with it (``halserve.kv_cache.register_spec_kind``),
                       run for each backend claiming it; ``warned`` when it registered none
    an unknown kind    failed: no one registered it, so no layer can ever ask for it

A claimed kind whose check raises, or an MLA backend without ``forward_mla``, fails with the kind named.
"""
from __future__ import annotations

import math
from typing import Any

from halserve.plugins.testing.results import ConformanceReport
from halserve.plugins.testing.target import Target

ATTENTION_KINDS = ("full_attention", "sliding_window")  # checked by the attention scenarios themselves
MLA_DIMS = dict(rank=32, nope=16, rope=8, v_dim=16, heads=4)
MLA_SCENARIOS = ("prefill_only", "decode_only", "prefix_hit_chunked", "mixed", "fp8_kv")
MLA_K_SCALE = 0.5


def claimed_kinds(cls: type) -> tuple[str, ...]:
    """The backend's ``kv_cache_spec_kinds()``; () when it raises (reported by ``check_claimed_kinds``)."""
    try:
        return tuple(cls.kv_cache_spec_kinds())  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        return ()


def check_claimed_kinds(report: ConformanceReport, subject: str, cls: type, target: Target, quick: bool,
                        fp8_platform: str | None = None) -> None:
    """One or more rows per kind ``cls`` claims beyond full attention and sliding windows (``fp8_platform``:
    the fp8 flavour the target platform allocates for "fp8")."""
    from halserve.kv_cache.spec_kinds import known_spec_kinds

    try:
        kinds = tuple(cls.kv_cache_spec_kinds())  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001
        report.add("attention", subject, "kv_cache_spec_kinds", "failed",
                   f"kv_cache_spec_kinds() raised {type(exc).__name__}: {exc}")
        return
    known = known_spec_kinds()
    for kind in kinds:
        if kind in ATTENTION_KINDS:
            continue
        case = f"kind {kind}"
        registered = known.get(kind)
        if registered is None:
            report.add("attention", subject, case, "failed",
                       f"attention backend {subject} claims the KV-cache kind {kind!r}, which no one registered "
                       f"(known: {', '.join(known)}); register it with halserve.kv_cache.register_spec_kind")
        elif kind == "mla":
            _check_mla(report, subject, cls, target, quick, fp8_platform)
        elif registered.conformance is None:
            why = ("halserve has no backend check for it" if registered.plugin is None
                   else f"plugin {registered.plugin!r} registered it without a conformance check")
            report.add("attention", subject, case, "warned", f"claimed but not checked: {why}")
        elif not target.runnable:
            report.add("attention", subject, case, "declined", target.reason)
        else:
            assert target.device is not None  # (runnable)
            try:
                detail = registered.conformance(cls, target.device)
            except Exception as exc:  # noqa: BLE001 - a claimed kind that is wrong or raises fails
                report.add("attention", subject, case, "failed",
                           f"attention backend {subject}, KV-cache kind {kind!r} (check of plugin "
                           f"{registered.plugin!r}): {type(exc).__name__}: {exc}")
            else:
                report.add("attention", subject, case, "passed", str(detail))


# -- MLA --------------------------------------------------------------------------------


def _check_mla(report: ConformanceReport, subject: str, cls: Any, target: Target, quick: bool,
               fp8_platform: str | None) -> None:
    from halserve.plugins.testing import attention

    if not callable(getattr(cls, "forward_mla", None)):
        report.add("attention", subject, "kind mla", "failed", f"attention backend {subject} claims the mla "
                   "KV-cache kind but has no forward_mla (halserve.layers.mla.MLAAttention calls it)")
        return
    fp8_kv = next((d for d in ("fp8", "fp8_e4m3", "fp8_e5m2") if d in getattr(cls, "kv_cache_dtypes", ())), None)
    for dtype, head_size, block_size in attention._combos(cls, quick, target.interpreter):
        for sc in attention.scenarios(block_size, fp8_kv):
            if sc.name not in MLA_SCENARIOS:
                continue
            label = f"mla {sc.name} {dtype} block_size={block_size}"
            if sc.kv_cache_dtype != "auto":
                label += f" kv={sc.kv_cache_dtype}"
            try:
                reason = cls.supports(dtype=dtype, head_size=head_size, block_size=block_size,
                                      kv_cache_dtype=sc.kv_cache_dtype)
            except Exception as exc:  # noqa: BLE001
                report.add("attention", subject, label, "failed", f"supports() raised {type(exc).__name__}: {exc}")
                continue
            if reason is None and not target.runnable:
                reason = target.reason
            elif reason is None and target.interpreter and dtype == "bfloat16":
                reason = attention.INTERPRETER_BF16_REASON
            elif reason is None and target.interpreter and sc.kv_cache_dtype != "auto":
                reason = attention.INTERPRETER_FP8_REASON
            if reason is not None:
                report.add("attention", subject, label, "declined", reason)
                continue
            try:
                detail = run_mla_and_compare(cls, sc, dtype, block_size, target, fp8_platform)
            except Exception as exc:  # noqa: BLE001 - a mismatch (_Mismatch) or a raise, both failures
                what = str(exc) if isinstance(exc, attention._Mismatch) else f"raised {type(exc).__name__}: {exc}"
                report.add("attention", subject, label, "failed", f"attention backend {subject}, case {label}: {what}")
            else:
                report.add("attention", subject, label, "passed", detail)


def run_mla_and_compare(cls: Any, sc: Any, dtype_name: str, block_size: int, target: Target,
                        fp8_platform: str | None = None) -> str:
    """Every step of ``sc`` through ``cls.forward_mla`` and the torch reference's, each on its own latent
    cache (garbage first); ``_Mismatch`` on the first step past the tolerance."""
    import torch

    from halserve.attention_backends.torch_ref import TorchAttentionBackend
    from halserve.kv_cache.spec import MLASpec
    from halserve.plugins.testing import attention

    dtype = getattr(torch, dtype_name)
    rank, nope, rope, v_dim, heads = (MLA_DIMS[k] for k in ("rank", "nope", "rope", "v_dim", "heads"))
    g = torch.Generator().manual_seed(4321)
    q_nope = [torch.randn(n, heads, nope, generator=g).to(dtype) for n in sc.lengths]
    q_pe = [torch.randn(n, heads, rope, generator=g).to(dtype) for n in sc.lengths]
    kv_c = [torch.randn(n, rank, generator=g).to(dtype) for n in sc.lengths]
    k_pe = [torch.randn(n, rope, generator=g).to(dtype) for n in sc.lengths]
    for r, (owner, num_shared) in sc.shares.items():  # a prefix hit: the owner's latents
        upto = num_shared * block_size
        kv_c[r][:upto], k_pe[r][:upto] = kv_c[owner][:upto], k_pe[owner][:upto]
    tables, num_blocks = attention.block_tables(sc, block_size, g)
    w_uk = (torch.randn(heads, nope, rank, generator=g) / math.sqrt(rank)).to(dtype)
    w_uv = (torch.randn(heads, v_dim, rank, generator=g) / math.sqrt(rank)).to(dtype)
    fp8 = sc.kv_cache_dtype != "auto"
    k_scale = MLA_K_SCALE if fp8 else 1.0
    garbage = torch.randn(MLASpec(rank, rope).cache_shape(num_blocks, block_size), generator=g) * 3
    scale = (nope + rope) ** -0.5
    args = (heads, nope + rope, scale, 1)
    impls = {
        "backend": (cls, cls(*args, kv_cache_dtype=sc.kv_cache_dtype), target.device),
        "reference": (TorchAttentionBackend, TorchAttentionBackend(*args, kv_cache_dtype=sc.kv_cache_dtype), "cpu"),
    }
    caches = {  # each in the fp8 flavour its platform allocates
        "backend": garbage.to(attention._cache_dtype(sc.kv_cache_dtype, dtype, fp8_platform)).to(target.device),
        "reference": garbage.to(attention._cache_dtype(sc.kv_cache_dtype, dtype, None)),
    }
    tol = attention.FP8_KV_TOLERANCE if fp8 else attention.TOLERANCE[dtype_name]
    weights = {dev: (w_uk.to(dev), w_uv.to(dev)) for _k, _i, dev in impls.values()}
    worst = 0.0
    for step_index, step in enumerate(sc.steps, start=1):
        inputs = [torch.cat([x[r][s : s + n] for r, s, n in step]) for x in (q_nope, q_pe, kv_c, k_pe)]
        starts = [0]
        for _r, _s, n in step:
            starts.append(starts[-1] + n)
        outs = {}
        for key, (klass, impl, dev) in impls.items():
            meta = klass.build_metadata(attention.step_metadata(step, tables, block_size, dev))
            outs[key] = impl.forward_mla(*[x.to(dev) for x in inputs], caches[key], meta, *weights[dev], k_scale)
        worst = max(worst, attention.compare_step(outs["backend"], outs["reference"], step, starts, step_index,
                                                  len(sc.steps), tol))
    return f"{len(sc.steps)} steps, max |error| {worst:.2e} of max |ref| (tolerance {tol:.0e})"
