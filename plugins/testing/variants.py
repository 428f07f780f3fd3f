"""Kit check ``variants`` (plugin API 2): a model variant greedy-identical to the built-in.

For every ``ModelArchitecture(..., platform=P, override=True)`` the plugin registers for an
architecture the kit can make a random checkpoint of (``tiny_model``: ``LlamaForCausalLM``,
``MistralForCausalLM``), the engine runs the e2e check's prompts greedily on platform ``P`` with the
torch reference attention (so only the model differs), and must give the tokens of the built-in
class on the same platform (the variant set aside for that run: ``overrides.builtin_model``). The run must really have built the variant (its model is an instance of
the registered class). Other architectures, or ``P`` unavailable here, are ``declined``.
"""
from __future__ import annotations

import importlib
import os
import tempfile
from typing import Any

from halserve.plugins.testing.results import ConformanceReport
from halserve.plugins.testing.target import TargetResolver

RANDOM_CHECKPOINTS = {"LlamaForCausalLM": None, "MistralForCausalLM": 64}  # architecture -> sliding window


def _variant_class(target: Any) -> type:
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)
    return target


def _generate(path: str, platform: str) -> tuple[list[list[int]], Any]:
    from halserve import LLM, SamplingParams
    from halserve.plugins.testing.e2e import ENGINE, MAX_TOKENS, PREFIX_HIT_PROMPT, PROMPTS

    llm = LLM(path, platform=platform, attention_backend="torch", dtype="float32", block_size=16, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        outs = llm.generate(PROMPTS + [PREFIX_HIT_PROMPT], params, use_tqdm=False)
        worker = getattr(getattr(getattr(llm.llm_engine, "core", None), "executor", None), "worker", None)
        model = getattr(getattr(worker, "model_runner", None), "model", None)  # None: not in this process
    finally:
        llm.llm_engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], model


def check_model_variants(report: ConformanceReport, manager: Any, resolver: TargetResolver) -> None:
    registry = getattr(manager, "model_variants", None) or ()
    mine = [reg for reg in registry if reg.plugin == report.plugin]
    if not mine:
        return
    with tempfile.TemporaryDirectory(prefix="halserve-variants-") as tmp:
        for reg in mine:
            platform, _, arch = reg.name.partition("/")
            subject = f"{arch} on {platform}"
            case = f"greedy vs built-in {arch}"
            if arch not in RANDOM_CHECKPOINTS:
                report.add("variant", subject, case, "declined",
                           f"the kit makes random checkpoints of {', '.join(RANDOM_CHECKPOINTS)} only")
                continue
            available, reason = resolver.probe(platform)
            if not available:
                report.add("variant", subject, case, "declined", f"platform {platform} unavailable here ({reason})")
                continue
            try:
                _compare(report, tmp, subject, case, platform, arch, _variant_class(reg.obj.target))
            except Exception as exc:  # noqa: BLE001 - a raising variant is a failed row, not a crashed kit
                report.add("variant", subject, case, "failed", f"{type(exc).__name__}: {exc}")


def _compare(report: ConformanceReport, tmp: str, subject: str, case: str, platform: str, arch: str,
             variant: type) -> None:
    from halserve.plugins.testing.e2e import PROMPTS, greedy_mismatch
    from halserve.plugins.testing.tiny_model import make_tiny_checkpoint

    path = os.path.join(tmp, arch)
    if not os.path.isdir(path):
        make_tiny_checkpoint(path, sliding_window=RANDOM_CHECKPOINTS[arch])
    from halserve.plugins.overrides import builtin_model

    with builtin_model(arch, platform):
        want, reference = _generate(path, platform)
    if reference is not None and isinstance(reference, variant):
        raise AssertionError(f"the reference run built the variant {variant.__name__}, not the built-in {arch}")
    got, model = _generate(path, platform)
    if model is not None and not isinstance(model, variant):
        report.add("variant", subject, case, "failed",
                   f"platform {platform} built {type(model).__name__}, not the registered variant {variant.__name__}")
        return
    mismatch = greedy_mismatch(got, want, f"the built-in {arch} on {platform}", "built-in")
    if mismatch is not None:
        report.add("variant", subject, case, "failed", mismatch)
        return
    report.add("variant", subject, case, "passed",
               f"{variant.__name__}: {len(PROMPTS) + 1} prompts x {len(want[0])} greedy tokens identical to the built-in "
               f"{arch} on platform {platform} (torch attention on both)")
