"""Kit check ``layers`` (plugin API 2): each layer override against its built-in on the same weights.

For every ``LayerOverride`` the plugin registers, the built-in and the replacement are built with
the same small arguments on the override's platform (float32), the built-in's random weights are
loaded into the replacement by name (``load_state_dict``: a missing or extra name fails), both run
the same inputs, and the outputs must agree within the fp32 tolerance of the kernel check (1e-4 of
max |reference|). A built-in with no case here, or a platform not available on this machine, is
``declined`` with the reason.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from halserve.plugins.testing.results import ConformanceReport

TOLERANCE = 1e-4  # relative to max |reference| (fp32), as the kernel check
HIDDEN, VOCAB, TOKENS = 64, 128, 7


def _ctx(platform: str, overrides: dict | None = None) -> Any:
    from halserve.attention_backends.torch_ref import TorchAttentionBackend
    from halserve.layers import ModelContext

    # no overrides inside the layers under test (but the quant method under test): each side is
    # exactly what it claims to be
    return ModelContext(platform, torch.float32, TorchAttentionBackend, layer_overrides=overrides or {})


def _norm(ctx: Any) -> tuple[tuple, list[Callable[[Any], Any]]]:
    x, residual = torch.randn(TOKENS, HIDDEN), torch.randn(TOKENS, HIDDEN)
    return (HIDDEN, 1e-6, ctx), [lambda m: m(x.clone()), lambda m: m(x.clone(), residual.clone())]


def _linear(args_of: Callable[[Any], tuple]) -> Callable[[Any], tuple[tuple, list]]:
    def case(ctx: Any) -> tuple[tuple, list]:
        x = torch.randn(TOKENS, HIDDEN)
        return args_of(ctx), [lambda m: m(x)]
    return case


def _embedding(ctx: Any) -> tuple[tuple, list]:
    ids = torch.randint(0, VOCAB, (TOKENS,))
    return (VOCAB, HIDDEN, ctx), [lambda m: m(ids)]


def _lm_head(ctx: Any) -> tuple[tuple, list]:
    hidden = torch.randn(TOKENS, HIDDEN)
    return (VOCAB, HIDDEN, ctx), [lambda m: m.compute_logits(hidden)]


def _rotary(ctx: Any) -> tuple[tuple, list]:
    head, heads, kv_heads = 32, 4, 2
    positions = torch.randint(0, 128, (TOKENS,))
    q, k = torch.randn(TOKENS, heads * head), torch.randn(TOKENS, kv_heads * head)
    params = {"rope_type": "default", "rope_theta": 10000.0}
    return (head, head, 128, params, 128, ctx), [lambda m: m(positions, q.clone(), k.clone())]


def _fused_moe(ctx: Any) -> tuple[tuple, list]:
    experts, top_k = 4, 2
    hidden, router_logits = torch.randn(TOKENS, HIDDEN), torch.randn(TOKENS, experts)
    return (experts, top_k, HIDDEN, 96, True, ctx, "layer"), [lambda m: m(hidden, router_logits)]


def _sampler(ctx: Any) -> tuple[tuple, list]:
    """Greedy rows (the argmax, exactly) and random rows restricted to one token by top_k=1:
    both leave a conforming sampler exactly one answer, whatever its random draw."""
    from halserve.sampling.metadata import SamplingMetadata

    rows = 5
    logits = torch.randn(rows, VOCAB)
    greedy = SamplingMetadata(num_reqs=rows, vocab_size=VOCAB, all_greedy=True, all_random=False)
    top1 = SamplingMetadata(num_reqs=rows, vocab_size=VOCAB, all_greedy=False, all_random=True,
                            temperature=torch.full((rows,), 0.8), top_k=torch.ones(rows, dtype=torch.int64),
                            max_top_k=1)
    return (), [lambda m: m(logits.clone(), greedy)[0], lambda m: m(logits.clone(), top1)[0]]


def _unquantized_method(ctx: Any) -> tuple[tuple, list]:
    """A replacement of the dense linear method, inside a ReplicatedLinear (``_compare`` builds the
    layer on each side: the built-in method, then the replacement through the context's overrides)."""
    x = torch.randn(TOKENS, HIDDEN)
    return (HIDDEN, 96, True), [lambda m: m(x)]


QUANT_METHOD_CASES = {"UnquantizedLinearMethod"}  # the others need a checkpoint's quantization config

# built-in class name -> (ctx -> (constructor arguments, [run(module) -> output(s)]))
CASES: dict[str, Callable[[Any], tuple[tuple, list]]] = {
    "RMSNorm": _norm,
    "GemmaRMSNorm": _norm,
    "ReplicatedLinear": _linear(lambda ctx: (HIDDEN, 96, True, ctx, "layer")),
    "ColumnParallelLinear": _linear(lambda ctx: (HIDDEN, 96, True, ctx, "layer")),
    "RowParallelLinear": _linear(lambda ctx: (HIDDEN, 96, True, ctx, "layer")),
    "MergedColumnParallelLinear": _linear(lambda ctx: (HIDDEN, [48, 48], True, ctx, "layer")),
    "QKVParallelLinear": _linear(lambda ctx: (HIDDEN, 16, 4, 2, True, ctx, "layer")),
    "VocabParallelEmbedding": _embedding,
    "ParallelLMHead": _lm_head,
    "RotaryEmbedding": _rotary,
    "FusedMoE": _fused_moe,
    "Sampler": _sampler,
    "UnquantizedLinearMethod": _unquantized_method,
}


def _flat(out: Any) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


def _finish(module: Any) -> None:
    """What the loader does after loading: the quant method's and the layer's own fix-ups."""
    method = getattr(module, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(module)
    elif callable(getattr(module, "process_weights_after_loading", None)):
        module.process_weights_after_loading()


def check_layer_overrides(report: ConformanceReport, manager: Any, plugin: str) -> None:
    for reg in getattr(manager, "layer_overrides", None) or ():
        if reg.plugin != plugin:
            continue
        override = reg.obj
        subject, name = f"{override.cls.__name__} ({reg.name})", override.replaces.__name__
        case_of = CASES.get(name)
        if case_of is None:
            report.add("layer", subject, f"vs {name}", "declined",
                       f"the kit has no case for {name} yet (cases: {', '.join(CASES)})")
            continue
        platform = manager.platforms.get(override.platform)
        probe = platform.obj.probe() if platform is not None else None
        if probe is None or not probe.available:
            reason = probe.reason if probe is not None else "not registered"
            report.add("layer", subject, f"vs {name}", "declined", f"platform {override.platform} unavailable ({reason})")
            continue
        try:
            _compare(report, subject, name, override, case_of)
        except Exception as exc:  # noqa: BLE001 - a raising layer is a failed row, not a crashed kit
            report.add("layer", subject, f"vs {name}", "failed", f"{type(exc).__name__}: {exc}")


def _compare(report: ConformanceReport, subject: str, name: str, override: Any, case_of: Callable) -> None:
    device = torch.device("cpu")  # (the kit runs the reference on the host; a device platform's
    ctx = _ctx(override.platform)  # layers move their own tensors)
    torch.manual_seed(0)
    args, runs = case_of(ctx)
    with device:
        if name in QUANT_METHOD_CASES:  # the same linear layer, on the built-in method and on the replacement
            from halserve.layers import ReplicatedLinear

            size_in, size_out, bias = args
            builtin = ReplicatedLinear(size_in, size_out, bias, ctx, "layer")
            mine = ReplicatedLinear(size_in, size_out, bias,
                                    _ctx(override.platform, {override.replaces: (override.cls, "kit")}), "layer")
            if not isinstance(mine.quant_method, override.cls):
                raise TypeError(f"the layer took {type(mine.quant_method).__name__}, not {override.cls.__name__}")
        else:
            builtin = override.replaces(*args)
            mine = override.cls(*args)
        if isinstance(builtin, torch.nn.Module):  # (a sampler has no weights)
            for param in builtin.parameters():
                param.data.copy_(torch.randn_like(param) * 0.5
                                 + (1.0 if param.dim() == 1 and "norm" in name.lower() else 0.0))
            mine.load_state_dict(builtin.state_dict(), strict=True)  # same names and shapes, or it raises
    _finish(builtin)
    _finish(mine)
    for index, run in enumerate(runs):
        case = f"vs {name} #{index}"
        with torch.no_grad():
            expected, got = _flat(run(builtin)), _flat(run(mine))
        if len(expected) != len(got):
            report.add("layer", subject, case, "failed", f"returned {len(got)} tensors, {name} returns {len(expected)}")
            continue
        worst = 0.0
        for want, have in zip(expected, got):
            if want.shape != have.shape:
                report.add("layer", subject, case, "failed", f"shape {tuple(have.shape)}, {name} gives {tuple(want.shape)}")
                break
            scale = float(want.abs().max()) or 1.0
            worst = max(worst, float((have.float() - want.float()).abs().max()) / scale)
        else:
            report.add("layer", subject, case, "passed" if worst <= TOLERANCE else "failed", f"max error {worst:.2e} of max |{name}| (tolerance {TOLERANCE:.0e})")
