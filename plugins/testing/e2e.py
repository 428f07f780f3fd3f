"""End-to-end conformance: greedy generation on a tiny random model equals the CPU reference.

The run under test uses the plugin's platform (when available here) with its own
backend choice, or the plugin's attention backend forced on a platform it runs on
(``cpu`` for ``"*"``/``"cpu"`` backends). The reference is ``platform="cpu",
attention_backend="torch"``. A small token budget forces chunked prefills and mixed
prefill/decode steps; a second request re-uses a cached prefix.
"""
from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

from halserve.plugins.testing.results import ConformanceReport
from halserve.plugins.testing.target import TargetResolver

if TYPE_CHECKING:  # pragma: no cover
    from halserve.attention_backends.base import AttentionBackend
    from halserve.platforms.base import Platform

PROMPTS = [
    "the quick brown fox jumps over the lazy dog and then",
    "hi",
    "tell me a story about paris, the capital of france",
]
PREFIX_HIT_PROMPT = "the quick brown fox jumps over the lazy dog but not"  # shares 2+ blocks with PROMPTS[0]
MAX_TOKENS = 8
ENGINE: dict[str, Any] = dict(max_model_len=128, num_kv_blocks=96, max_num_batched_tokens=16, max_num_seqs=4)


def greedy_mismatch(got: list[list[int]], want: list[list[int]], reference: str, label: str) -> str | None:
    """Where greedy tokens for the kit's prompts (``PROMPTS``, then ``PREFIX_HIT_PROMPT``) first part
    from ``reference``'s (named in the message, e.g. "the CPU reference"; ``label`` its tokens), or
    None when they agree. A shorter output parts where it ends."""
    prompts = PROMPTS + [PREFIX_HIT_PROMPT]
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            first = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            return (f"prompt {i} ({prompts[i]!r}) differs from {reference} at generated token {first}: "
                    f"got {g}, {label} {w}")
    return None


class _E2E:
    def __init__(self, quick: bool):
        self.quick = quick
        self.tmp = tempfile.TemporaryDirectory(prefix="halserve-conformance-")
        self.checkpoints: dict[int, str] = {}
        self.references: dict[tuple, list[list[int]]] = {}

    def checkpoint(self, head_size: int) -> str:
        from halserve.plugins.testing.tiny_model import make_tiny_checkpoint

        if head_size not in self.checkpoints:
            path = os.path.join(self.tmp.name, f"tiny-h{head_size}")
            self.checkpoints[head_size] = make_tiny_checkpoint(path, head_size=head_size)
        return self.checkpoints[head_size]

    def generate(self, path: str, platform: str, backend: str | None, dtype: str, block_size: int) -> tuple[list, str]:
        from halserve import LLM, SamplingParams

        llm = LLM(path, platform=platform, attention_backend=backend, dtype=dtype, block_size=block_size, **ENGINE)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        try:
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            outs += llm.generate([PREFIX_HIT_PROMPT], params, use_tqdm=False)  # a prefix-cache hit
        finally:
            llm.llm_engine.shutdown()
        return [list(o.outputs[0].token_ids) for o in outs], ""

    def reference(self, path: str, dtype: str, block_size: int) -> list[list[int]]:
        key = (path, dtype, block_size)
        if key not in self.references:
            self.references[key] = self.generate(path, "cpu", "torch", dtype, block_size)[0]
        return self.references[key]


def _shape_for(backend_cls: type[AttentionBackend] | None) -> tuple[int, int]:
    """(head size, block size) the backend accepts: 32/16 unless it declares otherwise."""
    head, block = 32, 16
    if backend_cls is not None:
        if backend_cls.head_sizes and head not in backend_cls.head_sizes:
            head = sorted(backend_cls.head_sizes)[0]
        if backend_cls.block_sizes and block not in backend_cls.block_sizes:
            block = sorted(backend_cls.block_sizes)[0]
    return head, block


def check_e2e(report: ConformanceReport, manager: Any, resolver: TargetResolver, quick: bool) -> None:
    run = _E2E(quick)
    try:
        covered: set[str] = set()
        for reg in manager.platforms.by_plugin(report.plugin):
            _platform_case(report, manager, resolver, run, reg, covered)
        for reg in manager.attention_backends.by_plugin(report.plugin):
            if reg.name not in covered:
                _backend_case(report, manager, resolver, run, reg, covered)
    finally:
        run.tmp.cleanup()


def _dtype_for(platform_cls: type[Platform]) -> str:
    return "float32" if "float32" in platform_cls.supported_dtypes else platform_cls.default_dtype


def _platform_case(report, manager, resolver, run: _E2E, reg, covered: set[str]) -> None:
    name = reg.name
    case = f"greedy generation on platform {name}"
    available, reason = resolver.probe(name)
    if not available:
        report.add("e2e", name, case, "declined", f"platform {name} unavailable here ({reason})")
        return
    backend_cls = next((manager.attention_backends[b].obj for b in reg.obj.preferred_attention_backends
                        if b in manager.attention_backends), None)
    _compare(report, run, name, case, platform=name, backend=None, backend_cls=backend_cls,
             dtype=_dtype_for(reg.obj), covered=covered, manager=manager)


def _backend_case(report, manager, resolver, run: _E2E, reg, covered: set[str]) -> None:
    cls = reg.obj
    own = [r for r in manager.platforms.by_plugin(report.plugin) if cls.runs_on(r.name) and resolver.probe(r.name)[0]]
    if own:
        platform_cls = own[0].obj
    elif cls.runs_on("cpu"):
        platform_cls = manager.platforms["cpu"].obj
    else:
        unavailable = "; ".join(f"{p}: {resolver.probe(p)[1]}" for p in cls.platforms)
        report.add("e2e", reg.name, "greedy generation", "declined",
                   f"backend {reg.name} runs only on {', '.join(cls.platforms)}, unavailable here ({unavailable}); "
                   "the engine runs a backend only on a platform it declares")
        return
    case = f"greedy generation with {reg.name} on platform {platform_cls.name}"
    _compare(report, run, reg.name, case, platform=platform_cls.name, backend=reg.name, backend_cls=cls,
             dtype=_dtype_for(platform_cls), covered=covered, manager=manager)


def _compare(report, run: _E2E, subject, case, *, platform, backend, backend_cls, dtype, covered, manager) -> None:
    head, block = _shape_for(backend_cls)
    case += f" ({dtype}, head_size={head}, block_size={block})"
    try:
        path = run.checkpoint(head)
        want = run.reference(path, dtype, block)
    except Exception as exc:  # noqa: BLE001 - the reference itself broke: not the plugin's fault
        report.add("e2e", subject, case, "failed", f"the CPU reference run failed: {type(exc).__name__}: {exc}")
        return
    try:
        got, _ = run.generate(path, platform, backend, dtype, block)
    except Exception as exc:  # noqa: BLE001
        report.add("e2e", subject, case, "failed", f"generation raised {type(exc).__name__}: {exc}")
        return
    if backend_cls is not None:
        covered.add(backend_cls.name)
    mismatch = greedy_mismatch(got, want, "the CPU reference", "reference")
    if mismatch is not None:
        report.add("e2e", subject, case, "failed", mismatch)
        return
    report.add("e2e", subject, case, "passed",
               f"{len(PROMPTS) + 1} prompts x {MAX_TOKENS} greedy tokens identical to platform cpu + torch attention")
