"""The Llama family's forward on the CPU without the module tree: the same kernels, called directly.

A decode step of a small model is mostly Python around its kernels: SmolLM2-135M's ~9-10 ms step
(2 cores) was ~3.5 ms of GGUF GEMVs and ~5 ms of the modules' own Python (``nn.Module.__call__`` x 364,
``Module.__getattr__`` x 548, each GEMM through ``LinearBase.forward -> QuantMethod.apply -> kernel``;
BENCHMARKS.md, "Per-step overhead of single-stream decode"). ``LlamaFlatForward`` is built once per
model (at its first real step) and runs ``LlamaModel.forward`` as one loop over per-layer records of
bound kernels, parameters and sizes::

    hidden = embed(input_ids)                                   # [T, H]
    per layer:  x, residual = rms_norm(hidden, w_in, eps, residual)   (first layer: residual = hidden)
                qkv = apply(qkv_proj, x) -> q | k | v           # [T, (Hq + 2 Hk) D]
                (Qwen3: q_norm, k_norm per head)
                q, k = rope(positions, q, k, cos_sin, D, neox)
                o = attention(q, k, v)                          # cpu_native decode step: write_kv + paged_decode
                x, residual = rms_norm(apply(o_proj, o), w_post, eps, residual)
                hidden = apply(down, silu_and_mul(apply(gate_up, x)))
    hidden, _ = rms_norm(hidden, w_final, eps, residual)

Every call is the one the module path makes (the same kernel objects, arguments and order: each linear
goes through its quant method's ``apply``, as ``LinearBase.forward`` does at one tensor-parallel rank), so
the output is bit-identical to the module path's (tests/models/test_llama_flat.py compares greedy tokens
and hidden states). Attention calls the layer's backend as ``Attention.forward`` does; on a decode-only
step with the ``cpu_native`` backend (every request one token, in order) it calls that backend's two
kernels directly, which is what its ``forward`` does for such a step; in float32 with the native rotary it
hands the qkv rows to ``rotary_write_decode``, which runs the rotary, ``write_kv`` and ``paged_decode``
functions in one C++ call (~11 Python-level calls a layer fewer).

Where it does not apply, ``why_not`` says why (logged once at debug level) and the model keeps the
module path: a platform other than ``cpu``; tensor or pipeline parallelism; a model whose classes are not
exactly Llama's (MoE MLPs, Gemma, DeepSeek, Bamba, plugins' layer overrides: every module's type is checked);
M-RoPE; LoRA (its wrappers replace the linear modules: a type check fails at build, and each step checks
the linear modules are still the ones bound); forward hooks on any module. Per step it also falls back for a
dummy run (no attention metadata), a KV connector, a hybrid model's per-group metadata, ``inputs_embeds``
and intermediate tensors.

A float32 GGUF model (every linear GGUF blocks on the cpu_native kernel, the native norm and rotary, no q/k
norms, the cpu_native backend) runs a plain decode step's decoder layers in one C++ call instead of this loop:
``DecodePlan`` (platforms/cpu_kernels/decode_plan.cpp), the same kernels with the same arguments in the same
order, so bit-identical, with no Python between them (a single stream's step was ~2 ms of Python and dispatch
around ~4 ms of kernels; the plan holds the repacked weights and KV caches and is made again when a cache is
another tensor or a weight is written).

``HALSERVE_FLAT_FORWARD=0`` turns it off (the module path for every step: to compare the two, or to rule
it out); ``HALSERVE_FLAT_FORWARD=python`` keeps the loop in Python (no decode plan); read when the model first
runs.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from halserve.attention_backends.cpu_native import kernels_take_cache
from halserve.forward_context import get_forward_context

if TYPE_CHECKING:  # pragma: no cover
    from halserve.models.llama import LlamaForCausalLM

FLAT_FORWARD_ENV = "HALSERVE_FLAT_FORWARD"


def decode_plan_enabled() -> bool:
    """``HALSERVE_FLAT_FORWARD=python`` keeps the flat loop in Python on every step (no ``DecodePlan``)."""
    return os.environ.get(FLAT_FORWARD_ENV, "").strip().lower() != "python"


def flat_forward_enabled() -> bool:
    """False when ``HALSERVE_FLAT_FORWARD`` is 0 / false / off / no."""
    return os.environ.get(FLAT_FORWARD_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or getattr(module, "_backward_pre_hooks", None))


def _global_hooks() -> bool:
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
                or torch_module._global_backward_hooks or getattr(torch_module, "_global_backward_pre_hooks", None))


def _linear_call(layer: nn.Module, checks: list[tuple[dict, str, Any]]):
    """``x -> layer(x)`` at one tensor-parallel rank, without the module call: the quant method's ``apply``
    with the layer's bias (``ColumnParallelLinear.forward`` / ``RowParallelLinear.forward`` at tp 1).

    A GGUF layer of one block type calls its ``gguf_gemm`` kernel directly (what ``GgufLinearMethod.apply``
    does for one run); ``checks`` gets the layer's ``gguf_runs`` list, so a reload that rebinds them is seen.
    A kernel that offers ``bind`` (the cpu_native one) hands back its call with the per-call bookkeeping done
    once; the dispatch by row count stays the kernel's business."""
    bias = layer.bias
    run = _single_gguf_run(layer)
    if run is not None:
        checks.append((layer.__dict__, "gguf_runs", layer.gguf_runs))
        kernel, qweight, qtype = run
        bind = getattr(kernel, "bind", None)
        if bind is not None:
            return bind(qweight, qtype, bias)

        def gguf_call(x: torch.Tensor) -> torch.Tensor:
            return kernel(x, qweight, qtype, bias)

        return gguf_call
    apply = layer.quant_method.apply

    def call(x: torch.Tensor) -> torch.Tensor:
        return apply(layer, x, bias)

    return call


def _single_gguf_run(layer: nn.Module) -> tuple | None:
    """``(kernel, qweight, qtype)`` of a GGUF layer of one block type (``GgufLinearMethod``'s one run), else None."""
    from halserve.quant_methods.gguf import GgufLinearMethod

    runs = getattr(layer, "gguf_runs", None)
    if type(layer.quant_method) is not GgufLinearMethod or runs is None or len(runs) != 1:
        return None
    return runs[0]


def _native_gguf_linear(layer: nn.Module):
    """``(kernel, qweight, qtype, bias)`` when ``layer`` runs one GGUF block type on the cpu_native kernel (the
    calls a ``DecodePlan`` can make itself), else None."""
    from halserve.platforms.cpu_kernels.native_gguf import NativeGgufGemm

    run = _single_gguf_run(layer)
    if run is None:
        return None
    kernel, qweight, qtype = run
    if type(kernel) is not NativeGgufGemm or qweight.dim() != 2:
        return None
    bias = layer.bias
    if bias is not None and (bias.dtype != torch.float32 or bias.dim() != 1):
        return None
    return kernel, qweight, qtype, bias


class _Layer:
    """One decoder layer's bound pieces (``__slots__``: plain attribute reads in the step loop)."""

    __slots__ = ("norm_in", "w_in", "eps_in", "norm_post", "w_post", "eps_post", "qkv", "o", "gate_up", "down",
                 "act", "q_size", "kv_size", "head_size", "num_heads", "num_kv_heads", "qk_norm", "attn",
                 "backend", "native_decode", "gguf")


class LlamaFlatForward:
    """``LlamaModel.forward`` for one model as a flat loop (module docstring). ``why_not`` checks the model
    first; calling it runs one step, or returns None for a step it leaves to the module path."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        from halserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

        inner = model.model
        self.model = model
        self.embed = inner.embed_tokens
        self.rotary = inner.layers[inner.start_layer].self_attn.rotary_emb
        final = inner.norm
        self.norm_final, self.w_final, self.eps_final = final.kernel, final.weight, final.eps
        self.layers: list[_Layer] = []
        # A float32 model on the cpu platform's fused kernels (platforms/cpu_kernels/fused.py) calls their C++ ops
        # directly where those kernels' __call__ would (float32 2-D rows: add_rms_norm with a residual, rotary):
        # the same op on the same tensors, without the wrapper's checks (~3 us each, 91 calls per SmolLM2 step).
        from halserve.platforms.cpu_kernels.fused import CpuFusedRmsNorm, CpuFusedRotaryEmbedding

        is_float32 = self.embed.dtype == torch.float32
        norm_kernels = [final.kernel] + [k for d in list(inner.layers)[inner.start_layer:inner.end_layer]
                                         for k in (d.input_layernorm.kernel, d.post_attention_layernorm.kernel)]
        self.add_rms_norm = None  # native add_rms_norm(x, residual, w, eps) -> [out, x + residual], or None
        if is_float32 and all(type(k) is CpuFusedRmsNorm for k in norm_kernels):
            self.add_rms_norm = norm_kernels[0].native.add_rms_norm
        self.native_rotary = None  # native rotary(positions, q, k, cos_sin, head_size, is_neox) -> [q, k], or None
        if is_float32 and type(self.rotary.kernel) is CpuFusedRotaryEmbedding:
            self.native_rotary = self.rotary.kernel.native.rotary
        # (a dict, key, what was bound from it): the linear modules a step runs (and a GGUF layer's runs),
        # checked each step
        checks: list[tuple[dict, str, Any]] = []
        for decoder in list(inner.layers)[inner.start_layer:inner.end_layer]:
            attn, mlp = decoder.self_attn, decoder.mlp
            rec = _Layer()
            rec.norm_in, rec.w_in, rec.eps_in = (decoder.input_layernorm.kernel, decoder.input_layernorm.weight,
                                                 decoder.input_layernorm.eps)
            post = decoder.post_attention_layernorm
            rec.norm_post, rec.w_post, rec.eps_post = post.kernel, post.weight, post.eps
            rec.gguf = [_native_gguf_linear(linear) for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                                   mlp.down_proj)]
            rec.qkv, rec.o = _linear_call(attn.qkv_proj, checks), _linear_call(attn.o_proj, checks)
            rec.gate_up, rec.down = _linear_call(mlp.gate_up_proj, checks), _linear_call(mlp.down_proj, checks)
            rec.act = mlp.act_fn.kernel
            rec.q_size, rec.kv_size, rec.head_size = attn.q_size, attn.kv_size, attn.head_size
            rec.num_heads, rec.num_kv_heads = attn.num_heads, attn.num_kv_heads
            rec.qk_norm = ((attn.q_norm.kernel, attn.q_norm.weight, attn.q_norm.eps,
                            attn.k_norm.kernel, attn.k_norm.weight, attn.k_norm.eps) if attn.has_qk_norm else None)
            rec.attn = attn.attn
            rec.backend = attn.attn.backend
            from halserve.attention_backends.cpu_native import CpuNativeAttentionBackend

            # the cpu_native backend's decode constants (scale, window, soft cap), or None: another backend
            rec.native_decode = (rec.backend.decode_constants() if type(rec.backend) is CpuNativeAttentionBackend
                                 else None)
            for parent, names in ((attn, ("qkv_proj", "o_proj")), (mlp, ("gate_up_proj", "down_proj"))):
                for name in names:
                    checks.append((parent._modules, name, parent._modules[name]))
            assert type(attn.qkv_proj) is QKVParallelLinear and type(attn.o_proj) is RowParallelLinear
            assert type(mlp.gate_up_proj) is MergedColumnParallelLinear and type(mlp.down_proj) is RowParallelLinear
            self.layers.append(rec)
        self._check_keys = [(modules, name) for modules, name, _ in checks]
        self._bound = [bound for _, _, bound in checks]  # (held: their ids cannot go to other objects)
        self._bound_ids = [id(bound) for bound in self._bound]
        # The C++ decode plan (decode_plan.cpp): built at the first plain decode step it can serve, made again when a
        # layer's KV cache is another tensor or a GGUF weight was written (its run says so); None until then, False
        # where it cannot serve this model
        self._plan: Any = None if decode_plan_enabled() and self._plan_applies() else False
        self._plan_cache_ids: list[int] = []

    # -- applicability --------------------------------------------------------------------
    @classmethod
    def why_not(cls, model: nn.Module, platform_name: str) -> str | None:
        """Why ``model`` keeps the module path (None: the flat forward serves it)."""
        from halserve.distributed import get_pp_state, get_tp_size
        from halserve.layers import (
            Attention,
            MergedColumnParallelLinear,
            QKVParallelLinear,
            RMSNorm,
            RowParallelLinear,
            SiluAndMul,
            VocabParallelEmbedding,
        )
        from halserve.layers.rotary import RotaryEmbedding
        from halserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

        if not flat_forward_enabled():
            return f"{FLAT_FORWARD_ENV}=0"
        if not isinstance(model, LlamaForCausalLM):  # (Gemma borrows LlamaForCausalLM.forward)
            return f"{type(model).__name__} is not a LlamaForCausalLM"
        if platform_name != "cpu":
            return f"platform {platform_name!r} (the flat forward is the cpu platform's)"
        if get_tp_size() != 1:
            return "tensor parallelism (each linear's collectives)"
        pp = get_pp_state()
        if not (pp.is_first and pp.is_last):
            return "pipeline parallelism"
        kind = type(model)
        if kind.forward is not LlamaForCausalLM.forward:
            return f"{kind.__name__} has its own forward"
        inner = model.model
        if type(inner) is not LlamaModel:
            return f"its decoder is a {type(inner).__name__}, not a LlamaModel"
        expected: list[tuple[Any, type]] = [(inner.embed_tokens, VocabParallelEmbedding), (inner.norm, RMSNorm)]
        rotary = None
        for decoder in list(inner.layers)[inner.start_layer:inner.end_layer]:
            if type(decoder) is not LlamaDecoderLayer:
                return f"a decoder layer is a {type(decoder).__name__}"
            attn, mlp = decoder.self_attn, decoder.mlp
            for module, cls in ((attn, LlamaAttention), (mlp, LlamaMLP)):  # (before reading their submodules)
                if type(module) is not cls:  # a MoE block, another attention
                    return f"a {type(module).__name__} where {cls.__name__} is expected"
            expected += [(decoder.input_layernorm, RMSNorm), (decoder.post_attention_layernorm, RMSNorm),
                         (attn.qkv_proj, QKVParallelLinear),
                         (attn.o_proj, RowParallelLinear), (attn.attn, Attention), (attn.rotary_emb, RotaryEmbedding),
                         (mlp.gate_up_proj, MergedColumnParallelLinear), (mlp.down_proj, RowParallelLinear),
                         (mlp.act_fn, SiluAndMul)]
            if type(attn) is LlamaAttention and attn.has_qk_norm:
                expected += [(attn.q_norm, RMSNorm), (attn.k_norm, RMSNorm)]
            if rotary is None:
                rotary = attn.rotary_emb
            elif attn.rotary_emb is not rotary:
                return "the layers do not share one rotary table"
            if getattr(attn.attn, "kv_cache_group", None) is not None:
                return "a hybrid model's KV-cache groups"
        for module, cls in expected:
            if type(module) is not cls:  # a LoRA wrapper, a plugin's layer override, M-RoPE, another MLP
                return f"a {type(module).__name__} where {cls.__name__} is expected"
        for module in model.modules():
            if _has_hooks(module):
                return f"a forward hook on {type(module).__name__}"
        return None

    def is_current(self) -> bool:
        """The linear modules are still the ones bound (LoRA, say, would have replaced them) and no global
        module hook was registered since."""
        # (one list of ids built and compared: ~10 us a step for SmolLM2's 150 entries, where a generator of
        # `is` tests took ~100)
        return [id(modules[name]) for modules, name in self._check_keys] == self._bound_ids and not _global_hooks()

    # -- the C++ decode plan -----------------------------------------------------------------
    def _plan_applies(self) -> bool:
        """Every layer is what ``DecodePlan.run`` does: GGUF linears on the cpu_native kernel (one kernel setting for
        the int8 levels), the native fused norm and rotary, no q/k norms, the cpu_native backend."""
        if self.add_rms_norm is None or self.native_rotary is None or not self.layers:
            return False
        kernels = set()
        for rec in self.layers:
            if rec.qk_norm is not None or rec.native_decode is None or any(g is None for g in rec.gguf):
                return False
            if rec.head_size != self.rotary.head_size:
                return False
            kernels.update((g[0].forced_levels, g[0].min_activation_levels, g[0].isa) for g in rec.gguf)
        return len(kernels) == 1

    def _build_plan(self, native: Any) -> Any:
        """A ``DecodePlan`` of this model's layers as they are now (their repacked weights, KV caches), or False: a
        layer's KV cache is one the native kernels do not take under float32 activations."""
        from halserve.kernels.gguf_blocks import check_qtype
        from halserve.platforms.cpu_kernels.native_gguf import QTYPE_CODES

        if not all(rec.attn.kv_cache.numel() and kernels_take_cache(torch.float32, rec.attn.kv_cache.dtype)
                   for rec in self.layers):
            return False

        final_weight = self.w_final
        plan = native.DecodePlan(self.rotary.cos_sin_cache.float(), self.rotary.is_neox, final_weight, self.eps_final)
        for rec in self.layers:
            linears = []
            for kernel, qweight, qtype, bias in rec.gguf:
                block, size = check_qtype(qtype)
                k = qweight.shape[1] // size * block  # (the row's values: whole blocks)
                linears.append(native.GgufLinear(kernel.packed(qweight, qtype, k), QTYPE_CODES[qtype], qweight.shape[0],
                                                 k, kernel.isa_code, qweight, bias))
            kv_cache = rec.attn.kv_cache
            plan.add_layer(rec.w_in, rec.eps_in, rec.w_post, rec.eps_post, *linears, rec.num_heads, rec.num_kv_heads,
                           rec.head_size, kv_cache, kv_cache.shape[3] // rec.head_size, *rec.native_decode)
        self._plan_cache_ids = [id(rec.attn.kv_cache) for rec in self.layers]  # (held by the plan: ids stay theirs)
        return plan

    def _run_plan(self, hidden: torch.Tensor, positions: torch.Tensor, plain: tuple) -> torch.Tensor | None:
        """The decoder layers through the C++ plan on a plain decode step, or None: the Python loop runs them."""
        kernel0 = self.layers[0].gguf[0][0]
        if self._plan is None or [id(rec.attn.kv_cache) for rec in self.layers] != self._plan_cache_ids:
            self._plan = self._build_plan(plain[0])
            if self._plan is False:
                return None
        from halserve.platforms.cpu_kernels.native_gguf import PANEL_MIN_ROWS

        num_tokens = hidden.shape[0]
        if num_tokens >= PANEL_MIN_ROWS[kernel0.isa]:
            return None  # (the kernel's float panel path, where PANEL_MIN_ROWS is set)
        _, slots, block_table, seq_lens = plain
        levels = kernel0.activation_levels(num_tokens)
        out = self._plan.run(hidden, positions, slots, block_table, seq_lens, levels)
        if out is None:  # a GGUF weight was written since: repack and plan again
            self._plan = self._build_plan(plain[0])
            out = self._plan.run(hidden, positions, slots, block_table, seq_lens, levels)
        return out

    # -- a step ---------------------------------------------------------------------------
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """``input_ids``/``positions`` [T] -> hidden [T, H], or None: this step takes the module path."""
        context = get_forward_context()
        metadata = context.attn_metadata
        if metadata is None or context.kv_connector is not None or isinstance(metadata, list):
            return None
        if not self.is_current():
            return None
        num_tokens = input_ids.shape[0]
        rotary = self.rotary
        cos_sin, rope_head, is_neox = rotary.cos_sin_cache, rotary.head_size, rotary.is_neox
        native_rotary, add_rms_norm = self.native_rotary, self.add_rms_norm
        if native_rotary is not None:
            cos_sin = cos_sin.float()  # (a no-op: the table is float32; what the kernel passes)
        # the cpu_native backend's plain decode step (its forward's first branch; the layers share the step's
        # metadata): (kernel module, slot_mapping, block_table, seq_lens), or None
        first = self.layers[0] if self.layers else None
        plain = (first.backend.plain_decode(metadata, num_tokens)
                 if first is not None and first.native_decode is not None else None)
        # rotary, write_kv and paged_decode from the qkv rows in one C++ call (the same functions on the same
        # views), for float32 rows on the native rotary whose head size is the layers'
        fused = plain[0].rotary_write_decode if plain is not None and native_rotary is not None else None

        hidden = self.embed.forward(input_ids)  # [T, H]
        if fused is not None and self._plan is not False:
            out = self._run_plan(hidden, positions, plain)
            if out is not None:
                return out
        residual = None
        for rec in self.layers:
            if residual is None:
                residual = hidden
                x = rec.norm_in(hidden, rec.w_in, rec.eps_in, None)
            elif add_rms_norm is not None:
                x, residual = add_rms_norm(hidden, residual, rec.w_in, rec.eps_in)
            else:
                x, residual = rec.norm_in(hidden, rec.w_in, rec.eps_in, residual)
            qkv = rec.qkv(x)  # [T, (Hq + 2 Hk) D]
            attn, head = rec.attn, rec.head_size
            kv_cache = attn.kv_cache
            if kv_cache.numel() == 0:
                raise RuntimeError(f"attention layer {attn.prefix!r} has no kv_cache; the model runner must set it")
            if (fused is not None and rec.qk_norm is None and rope_head == head
                    and kernels_take_cache(qkv.dtype, kv_cache.dtype)):
                _, slots, block_table, seq_lens = plain
                out = fused(qkv, positions, cos_sin, rec.num_heads, rec.num_kv_heads, head, is_neox, kv_cache, slots,
                            block_table, seq_lens, kv_cache.shape[3] // head, *rec.native_decode)  # [T, Hq D]
            else:
                out = self._attention(rec, qkv, positions, cos_sin, kv_cache, metadata, plain)
            if add_rms_norm is not None:
                x, residual = add_rms_norm(rec.o(out), residual, rec.w_post, rec.eps_post)
            else:
                x, residual = rec.norm_post(rec.o(out), rec.w_post, rec.eps_post, residual)
            hidden = rec.down(rec.act(rec.gate_up(x)))
        if add_rms_norm is not None:
            hidden, _ = add_rms_norm(hidden, residual, self.w_final, self.eps_final)
        else:
            hidden, _ = self.norm_final(hidden, self.w_final, self.eps_final, residual)
        return hidden

    def _attention(self, rec: _Layer, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                   kv_cache: torch.Tensor, metadata: Any, plain: tuple | None) -> torch.Tensor:
        """One layer's attention from its qkv rows, op by op: ``LlamaAttention.forward``'s calls (q/k norms,
        rotary, the backend's ``forward``), or on a plain decode step the cpu_native backend's two kernels."""
        rotary, num_tokens, head = self.rotary, qkv.shape[0], rec.head_size
        q_size, kv_size = rec.q_size, rec.kv_size  # q | k | v: views of qkv's columns (its split)
        q, k, v = qkv.narrow(1, 0, q_size), qkv.narrow(1, q_size, kv_size), qkv.narrow(1, q_size + kv_size, kv_size)
        if rec.qk_norm is not None:  # per head: [T * H, D]
            qn, qw, qe, kn, kw, ke = rec.qk_norm
            q = qn(q.reshape(-1, head), qw, qe, None).view(-1, q_size)
            k = kn(k.reshape(-1, head), kw, ke, None).view(-1, kv_size)
        rope = self.native_rotary if self.native_rotary is not None else rotary.kernel
        q, k = rope(positions, q, k, cos_sin, rotary.head_size, rotary.is_neox)
        v = v.contiguous()
        q3 = q.view(num_tokens, rec.num_heads, head)
        k3 = k.view(num_tokens, rec.num_kv_heads, head)
        v3 = v.view(num_tokens, rec.num_kv_heads, head)
        if (plain is not None and rec.native_decode is not None and q3.is_contiguous()
                and kernels_take_cache(q3.dtype, kv_cache.dtype)):
            kernel, slots, block_table, seq_lens = plain
            block_size = kv_cache.shape[3] // head
            kernel.write_kv(kv_cache, k3, v3, slots, block_size)
            out = kernel.paged_decode(q3, kv_cache, block_table, seq_lens, block_size, *rec.native_decode)
        else:
            attn = rec.attn
            out = rec.backend.forward(q3, k3, v3, kv_cache, metadata, attn.k_scale, attn.v_scale)
        return out.reshape(num_tokens, rec.num_heads * head)


__all__ = ["FLAT_FORWARD_ENV", "LlamaFlatForward", "flat_forward_enabled"]
