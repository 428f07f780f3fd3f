"""The compile check's cases: the real launchers of every Triton kernel, in GPU shapes.

``cases`` is what ``python -m halserve.platforms.triton_kernels.compile_check`` and the
suite compile for each target; ``sweep_cases`` (``--sweep``) crosses every configuration
the kernels declare. Each case calls the launchers with CPU tensors of the problem's
shapes; under ``compile_check.compile_only`` that compiles for the target and launches
nothing.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from halserve.platforms.triton_kernels.compile_check import GpuTarget


def _attention_case(target: GpuTarget, *, dtype: str, head_size: int, qpk: int, block_size: int, decode: bool,
                    fp8_cache: bool = False, sliding_window: int | None = None, soft_cap: float | None = None,
                    num_splits: int = 1) -> None:
    """One step of the triton_paged backend: the KV write, then unified attention (+ split reduce)."""
    import torch

    from halserve.attention_backends import triton_paged_kernels as K

    num_kv_heads, num_reqs = 2, 4
    q_len = 1 if decode else 48
    seq_len = 1000
    num_tokens = num_reqs * q_len
    dt = getattr(torch, dtype)
    cache_dt = getattr(torch, target.fp8_dtype) if fp8_cache else dt
    blocks_per_req = -(-seq_len // block_size)
    num_blocks = num_reqs * blocks_per_req
    q = torch.empty(num_tokens, num_kv_heads * qpk, head_size, dtype=dt)
    k = torch.empty(num_tokens, num_kv_heads, head_size, dtype=dt)
    v = torch.empty_like(k)
    cache = torch.empty(2, num_blocks, block_size, num_kv_heads, head_size, dtype=cache_dt)
    slots = torch.zeros(num_tokens, dtype=torch.int64)
    block_table = torch.arange(num_blocks, dtype=torch.int32).reshape(num_reqs, blocks_per_req)
    seq_lens = torch.full((num_reqs,), seq_len, dtype=torch.int32)
    query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int32) * q_len
    K.write_kv_cache(k, v, cache[0], cache[1], slots, 0.5, 0.5)
    K.paged_attention(
        torch.empty_like(q), q, cache[0], cache[1], block_table, seq_lens, query_start_loc,
        num_reqs=num_reqs, max_query_len=q_len, scale=head_size ** -0.5, sliding_window=sliding_window,
        logits_soft_cap=soft_cap, k_scale=0.5, v_scale=0.5, num_splits=num_splits,
    )


def _mla_case(target: GpuTarget, *, dtype: str, heads: int, fp8_cache: bool = False, num_splits: int = 1) -> None:
    """A decode step of the triton_paged backend's MLA path at DeepSeek-V3's latent (rank 512, rope 64):
    the latent write, then the absorbed decode (+ split reduce). (Its prefills run the unified kernel
    on expanded heads of 192: ``attention/prefill-bf16-h192-mha-mla-expanded``.)"""
    import torch

    from halserve.attention_backends import triton_paged_mla_kernels as K

    rank, rope, num_reqs, seq_len, block_size = 512, 64, 4, 1000, 16
    dt = getattr(torch, dtype)
    blocks_per_req = -(-seq_len // block_size)
    cache = torch.empty(num_reqs * blocks_per_req, block_size, rank + rope,
                        dtype=getattr(torch, target.fp8_dtype) if fp8_cache else dt)
    K.write_mla_cache(torch.empty(num_reqs, rank, dtype=dt), torch.empty(num_reqs, rope, dtype=dt), cache,
                      torch.zeros(num_reqs, dtype=torch.int64), 0.5)
    q_lat = torch.empty(num_reqs, heads, rank, dtype=dt)
    K.mla_decode(torch.empty_like(q_lat), q_lat, torch.empty(num_reqs, heads, rope, dtype=dt), cache,
                 torch.arange(num_reqs * blocks_per_req, dtype=torch.int32).reshape(num_reqs, blocks_per_req),
                 torch.full((num_reqs,), seq_len, dtype=torch.int32), torch.arange(num_reqs + 1, dtype=torch.int32),
                 num_reqs=num_reqs, scale=192**-0.5, k_scale=0.5, num_splits=num_splits)


def _gemm_case(target: GpuTarget, *, kind: str, m: int, dtype: str = "bfloat16", group: int = 128) -> None:
    """A Llama-3-8B-sized projection (N=K=4096) through the registered GEMM kernel classes
    (``group``: the 4-bit GEMMs' group size, -1 per channel)."""
    import torch

    n = k = 4096
    out_dt = getattr(torch, dtype)
    if kind in ("fp8", "int8"):
        from halserve.platforms.triton_kernels.fp8_gemm import TritonFp8ScaledGemm
        from halserve.platforms.triton_kernels.int8_gemm import TritonInt8ScaledGemm

        qdt = torch.int8 if kind == "int8" else getattr(torch, target.fp8_dtype or "float8_e4m3fn")
        gemm = TritonInt8ScaledGemm() if kind == "int8" else TritonFp8ScaledGemm(upcast=not target.has_fp8_dot)
        a, b = torch.empty(m, k, dtype=qdt), torch.empty(n, k, dtype=qdt)
        gemm(a, b, torch.ones(m, 1), torch.ones(n, 1), out_dt, bias=torch.empty(n, dtype=out_dt))
        return
    if kind == "fp8_block":  # DeepSeek-V3 / Qwen3-FP8: 128 x 128 weight blocks, per-token-group activations
        from halserve.platforms.triton_kernels.fp8_block_gemm import TritonFp8BlockScaledGemm
        from halserve.platforms.triton_kernels.jit.fp8_block_gemm import per_token_group_quant

        fp8 = getattr(torch, target.fp8_dtype or "float8_e4m3fn")
        gemm = TritonFp8BlockScaledGemm(upcast=not target.has_fp8_dot)
        a, b = torch.empty(m, k, dtype=fp8), torch.empty(n, k, dtype=fp8)
        gemm(a, b, torch.ones(m, k // 128), torch.ones(n // 128, k // 128), (128, 128), out_dt,
             bias=torch.empty(n, dtype=out_dt))
        if target.has_fp8_dot:  # Triton cannot emit fp8 stores where the GPU has no fp8 (sm_80)
            per_token_group_quant(torch.empty(m, k, dtype=out_dt), fp8, 128)
        return
    from halserve.platforms.triton_kernels.wo4_gemm import TritonAwqGemm, TritonGptqGemm

    x = torch.empty(m, k, dtype=out_dt)
    groups = 1 if group == -1 else k // group
    scales = torch.empty(groups, n, dtype=out_dt)
    qzeros = torch.empty(groups, n // 8, dtype=torch.int32)
    if kind == "awq":
        TritonAwqGemm()(x, torch.empty(k, n // 8, dtype=torch.int32), qzeros, scales, group)
    else:
        g_idx = torch.arange(k, dtype=torch.int32) // (k if group == -1 else group)
        TritonGptqGemm()(x, torch.empty(k // 8, n, dtype=torch.int32), qzeros, scales,
                         g_idx if kind == "gptq_act_order" else None, group)


def _gguf_case(target: GpuTarget, *, qtype: str, m: int, dtype: str = "bfloat16") -> None:
    """A Llama-3-8B-sized projection (N=K=4096) in GGUF blocks of ``qtype`` (``torch.empty`` blocks: the
    compile only needs their shapes), with a bias."""
    import torch

    from halserve.kernels.gguf_blocks import row_bytes
    from halserve.platforms.triton_kernels.gguf import TritonGgufGemm

    n = k = 4096
    dt = getattr(torch, dtype)
    TritonGgufGemm()(torch.empty(m, k, dtype=dt), torch.empty(n, row_bytes(qtype, k), dtype=torch.uint8), qtype,
                     torch.empty(n, dtype=dt))


def _elementwise_case(target: GpuTarget, *, kind: str, dtype: str = "bfloat16", hidden: int = 4096,
                      head: int = 128) -> None:
    """The elementwise kernels at Llama-3-8B sizes (``hidden``: model width; the MLP's
    intermediate size is 3.5x; ``head``: rotary head size)."""
    import torch

    from halserve.platforms.triton_kernels.jit import activation, quant, rms_norm, rotary

    dt = getattr(torch, dtype)
    tokens = 64
    if kind == "rms_norm":
        x = torch.empty(tokens, hidden, dtype=dt)
        rms_norm.rms_norm(x, torch.empty(hidden, dtype=dt), 1e-6)
        rms_norm.rms_norm(x, torch.empty(hidden, dtype=dt), 1e-6, residual=torch.empty_like(x))
    elif kind in ("rotary_neox", "rotary_gptj"):
        rotary.rotary_embedding(torch.zeros(tokens, dtype=torch.int64), torch.empty(tokens, 32 * head, dtype=dt),
                                torch.empty(tokens, 8 * head, dtype=dt), torch.empty(4096, head, dtype=torch.float32),
                                head, kind == "rotary_neox")
    elif kind == "silu_and_mul":
        activation.silu_and_mul(torch.empty(tokens, 2 * (hidden * 7 // 2), dtype=dt))
    elif kind == "gelu_tanh_and_mul":
        activation.gelu_tanh_and_mul(torch.empty(tokens, 2 * (hidden * 7 // 2), dtype=dt))
    elif kind == "quant":
        x = torch.empty(tokens, hidden, dtype=dt)
        for qdt in filter(None, (target.fp8_dtype, "int8")):
            quant.quantize(x, getattr(torch, qdt), None, per_token=True)
            quant.quantize(x, getattr(torch, qdt), None, per_token=False)
            quant.quantize(x, getattr(torch, qdt), torch.ones(1), per_token=False)
    else:
        raise ValueError(f"unknown elementwise case {kind!r}")


def _moe_case(target: GpuTarget, *, tokens: int, dtype: str = "bfloat16", experts: int = 8, top_k: int = 2,
              hidden: int = 4096, inter: int = 14336) -> None:
    """One fused-MoE layer (default: Mixtral-8x7B, one rank) for ``tokens`` tokens: the align
    step runs on CPU tensors, then both grouped GEMMs compile with the tiles that token count
    picks. The weights are ``torch.empty`` (never touched, so never backed by memory)."""
    import torch

    from halserve.platforms.triton_kernels.jit.fused_moe import fused_moe

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    topk_weights, topk_ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1)
    fused_moe(torch.empty(tokens, hidden, dtype=dt), torch.empty(experts, 2 * inter, hidden, dtype=dt),
              torch.empty(experts, hidden, inter, dtype=dt), topk_weights, topk_ids)


def cases(target: GpuTarget) -> dict[str, Callable[[], None]]:
    """Every kernel on the configurations the plugins declare, in GPU shapes, for ``target``."""
    out: dict[str, Callable[[], None]] = {}

    def attn(name: str, **kw: Any) -> None:
        out[f"attention/{name}"] = lambda: _attention_case(target, **kw)

    for head_size in (64, 80, 96, 128, 256):
        for decode in (True, False):
            attn(f"{'decode' if decode else 'prefill'}-bf16-h{head_size}-gqa4-bs16", dtype="bfloat16",
                 head_size=head_size, qpk=4, block_size=16, decode=decode)
    for dtype, qpk, bs in (("float16", 1, 32), ("float32", 8, 64)):
        for decode in (True, False):
            attn(f"{'decode' if decode else 'prefill'}-{dtype}-h128-gqa{qpk}-bs{bs}", dtype=dtype, head_size=128,
                 qpk=qpk, block_size=bs, decode=decode)
    for decode in (True, False):
        attn(f"{'decode' if decode else 'prefill'}-bf16-h128-gqa7-bs32", dtype="bfloat16", head_size=128, qpk=7,
             block_size=32, decode=decode)
        attn(f"{'decode' if decode else 'prefill'}-bf16-h256-gqa2-window-softcap", dtype="bfloat16", head_size=256,
             qpk=2, block_size=16, decode=decode, sliding_window=256, soft_cap=50.0)
        if target.fp8_dtype:
            attn(f"{'decode' if decode else 'prefill'}-bf16-h128-gqa4-fp8cache", dtype="bfloat16", head_size=128,
                 qpk=4, block_size=16, decode=decode, fp8_cache=True)
    attn("decode-bf16-h128-gqa4-split8", dtype="bfloat16", head_size=128, qpk=4, block_size=16, decode=True,
         num_splits=8)
    # MLA (DeepSeek-V3 on 8 ranks: 16 heads; on one: 128), absorbed decode and the expanded prefill's heads
    for dtype, heads, fp8, splits in (("bfloat16", 16, False, 1), ("bfloat16", 128, False, 1),
                                      ("bfloat16", 16, True, 4), ("float16", 16, False, 8), ("float32", 16, False, 1)):
        name = f"mla/decode-{dtype}-heads{heads}" + ("-fp8cache" if fp8 else "") + (f"-split{splits}" if splits > 1 else "")
        if not fp8 or target.fp8_dtype:
            out[name] = lambda kw=dict(dtype=dtype, heads=heads, fp8_cache=fp8, num_splits=splits): _mla_case(target, **kw)
    attn("prefill-bf16-h192-mha-mla-expanded", dtype="bfloat16", head_size=192, qpk=1, block_size=16, decode=False)
    # the widest fp32 tiles (FMA dots hold their operands in registers)
    attn("decode-float32-h256-gqa8-split2", dtype="float32", head_size=256, qpk=8, block_size=16, decode=True,
         num_splits=2)
    attn("prefill-float32-h256-gqa8", dtype="float32", head_size=256, qpk=8, block_size=16, decode=False)
    for kind in ("fp8", "int8", "awq", "gptq", "gptq_act_order", "fp8_block"):
        for m in (1, 32, 64, 512):  # every M bucket of gemm_tiles
            out[f"gemm/{kind}-m{m}"] = lambda kind=kind, m=m: _gemm_case(target, kind=kind, m=m)
    out["gemm/awq-m64-fp16"] = lambda: _gemm_case(target, kind="awq", m=64, dtype="float16")
    for kind in ("awq", "gptq_act_order"):  # fp32 activations: FMA dots, their own tiles
        out[f"gemm/{kind}-m512-float32"] = lambda kind=kind: _gemm_case(target, kind=kind, m=512, dtype="float32")
    for qtype in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):  # decode and prefill rows, each type
        for m in (1, 512):
            out[f"gemm/gguf-{qtype}-m{m}"] = lambda qtype=qtype, m=m: _gguf_case(target, qtype=qtype, m=m)
    out["gemm/gguf-Q4_K-m64-fp16"] = lambda: _gguf_case(target, qtype="Q4_K", m=64, dtype="float16")
    out["gemm/gguf-Q8_0-m512-float32"] = lambda: _gguf_case(target, qtype="Q8_0", m=512, dtype="float32")
    for kind in ("rms_norm", "rotary_neox", "rotary_gptj", "silu_and_mul", "gelu_tanh_and_mul", "quant"):
        out[f"elementwise/{kind}"] = lambda kind=kind: _elementwise_case(target, kind=kind)
    # Mixtral-8x7B at 0.25, 16, 128 and 1024 rows per expert: every tile bucket of moe_tiles
    for tokens in (1, 64, 512, 4096):
        out[f"fused_moe/mixtral-bf16-t{tokens}"] = lambda tokens=tokens: _moe_case(target, tokens=tokens)
    out["fused_moe/mixtral-float16-t512"] = lambda: _moe_case(target, tokens=512, dtype="float16")
    out["fused_moe/mixtral-float32-t64"] = lambda: _moe_case(target, tokens=64, dtype="float32")
    # Qwen1.5-MoE-A2.7B: 60 small experts, top-4, intermediate 1408 (not a multiple of 128)
    out["fused_moe/qwen2moe-bf16-t256"] = lambda: _moe_case(target, tokens=256, experts=60, top_k=4, hidden=2048,
                                                             inter=1408)
    return out


def sweep_cases(target: GpuTarget) -> dict[str, Callable[[], None]]:
    """Every configuration the kernels declare, crossed. Attention: head sizes x dtypes x GQA
    ratios (1, 4, 8, 32) x decode (single pass, split) / prefill x model-dtype / fp8 cache.
    GEMMs: every M bucket x output dtype, the 4-bit GEMMs' group sizes (32, 128, per
    channel), every GGUF type. RMSNorm, SiLU-and-mul and quantization at model widths 2048-16384, rotary at
    head sizes 64-256, in every dtype. About 500 cases, minutes per target: a developer's
    check (``--sweep``), not the suite's."""
    out: dict[str, Callable[[], None]] = {}
    for kind, m, dtype in itertools.product(("fp8", "int8", "awq", "gptq", "gptq_act_order"), (1, 32, 64, 512),
                                            ("float16", "bfloat16", "float32")):
        for group in (32, 128, -1) if kind in ("awq", "gptq", "gptq_act_order") else (128,):
            name = f"sweep/gemm-{kind}-m{m}-{dtype}" + (f"-g{group}" if kind not in ("fp8", "int8") else "")
            out[name] = lambda kw=dict(kind=kind, m=m, dtype=dtype, group=group): _gemm_case(target, **kw)
    for qtype, m, dtype in itertools.product(("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"), (1, 32, 64, 512),
                                             ("float16", "bfloat16", "float32")):
        out[f"sweep/gemm-gguf-{qtype}-m{m}-{dtype}"] = lambda kw=dict(qtype=qtype, m=m, dtype=dtype): \
            _gguf_case(target, **kw)
    fp8_choices = (False, True) if target.fp8_dtype else (False,)
    for head_size, dtype, qpk, step in itertools.product(
        (64, 80, 96, 128, 256), ("float16", "bfloat16", "float32"), (1, 4, 8, 32), ("decode", "split4", "prefill")
    ):
        for fp8 in fp8_choices if dtype != "float32" else (False,):
            kw = dict(dtype=dtype, head_size=head_size, qpk=qpk, block_size=16, decode=step != "prefill",
                      fp8_cache=fp8, num_splits=4 if step == "split4" else 1)
            name = f"sweep/attention-{step}-{dtype}-h{head_size}-gqa{qpk}{'-fp8cache' if fp8 else ''}"
            out[name] = lambda kw=kw: _attention_case(target, **kw)
    dtypes = ("float16", "bfloat16", "float32")
    for kind, dtype, hidden in itertools.product(("rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "quant"), dtypes,
                                                 (2048, 5120, 7168, 8192, 16384)):  # 1B .. 405B-class widths
        out[f"sweep/{kind}-{dtype}-hidden{hidden}"] = lambda kw=dict(kind=kind, dtype=dtype, hidden=hidden): \
            _elementwise_case(target, **kw)
    for kind, dtype, head in itertools.product(("rotary_neox", "rotary_gptj"), dtypes, (64, 128, 256)):
        out[f"sweep/{kind}-{dtype}-head{head}"] = lambda kw=dict(kind=kind, dtype=dtype, head=head): \
            _elementwise_case(target, **kw)
    # fused MoE: Mixtral (8 x 14336, top-2) and Qwen-MoE (60 x 1408, top-4) x token counts x dtypes
    for (model, shape), tokens, dtype in itertools.product(
        (("mixtral", dict(experts=8, top_k=2, hidden=4096, inter=14336)),
         ("qwen2moe", dict(experts=60, top_k=4, hidden=2048, inter=1408))),
        (1, 16, 64, 256, 1024, 4096), dtypes,
    ):
        out[f"sweep/fused_moe-{model}-{dtype}-t{tokens}"] = lambda kw=dict(tokens=tokens, dtype=dtype, **shape): \
            _moe_case(target, **kw)
    return out
