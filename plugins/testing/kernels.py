"""Kernel conformance: every kernel a plugin registers vs the torch reference of its op.

For each generated case (``kernel_cases.py``) the kernel is asked ``supports(**problem)``;
a case it declines is recorded "declined" with its reason. A case it claims runs on the
target device (``target.py``) and is compared on the CPU with the reference run on the
same inputs; a wrong answer, a wrong shape or dtype, or an exception fails the case with
the op, kernel, case and the error measured against the tolerance.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from halserve.plugins.testing.kernel_cases import CASES, KernelCase
from halserve.plugins.testing.results import ConformanceReport
from halserve.plugins.testing.target import TargetResolver, interpreter_decline

if TYPE_CHECKING:  # pragma: no cover
    from halserve.kernels.base import Kernel

FP8_QUANT_MISMATCH = {False: 0.01, True: 0.10}  # share of q values allowed to differ (interpreter: triton#8322)


def check_kernels(report: ConformanceReport, manager: Any, resolver: TargetResolver, quick: bool) -> None:
    from halserve.kernels.ops import OPS
    from halserve.kernels.reference import REFERENCE_KERNELS

    references = {cls.op: cls for cls in REFERENCE_KERNELS}
    for reg in manager.kernels.by_plugin(report.plugin):
        cls = reg.obj
        subject = reg.name  # "<op>/<name>"
        problem = _declaration_problem(cls, OPS)
        if problem:
            report.add("kernel", subject, "declaration", "failed", problem)
            continue
        report.add("kernel", subject, "declaration", "passed",
                   f"op {cls.op}, platforms {', '.join(cls.platforms)}, priority {cls.priority}")
        target = resolver.target(cls)
        reference = references[cls.op]()
        for case in CASES[cls.op](quick):
            _run_case(report, subject, cls, reference, case, target)


def _declaration_problem(cls: type[Kernel], ops: dict) -> str | None:
    op = getattr(cls, "op", None)
    if op not in ops:
        return f"kernel class {cls.__qualname__} declares op {op!r}, which is not one of {', '.join(ops)}"
    if op not in CASES:
        return f"op {op!r} has no conformance cases in this version of the kit"
    platforms = getattr(cls, "platforms", None)
    if not platforms or not isinstance(platforms, tuple):
        return f"kernel {op}/{cls.name} must declare platforms as a non-empty tuple, got {platforms!r}"
    return None


def _run_case(report: ConformanceReport, subject: str, cls: type[Kernel], reference: Any, case: KernelCase, target) -> None:
    import torch

    try:
        reason = cls.supports(**case.problem)
    except Exception as exc:  # noqa: BLE001
        report.add("kernel", subject, case.label, "failed",
                   f"supports({_fmt(case.problem)}) raised {type(exc).__name__}: {exc}; it must return None or a reason")
        return
    if reason is not None:
        report.add("kernel", subject, case.label, "declined", f"kernel declines: {reason}")
        return
    if not target.runnable:
        report.add("kernel", subject, case.label, "declined", target.reason)
        return
    if target.interpreter and (why := interpreter_decline(case.dtypes)) is not None:
        report.add("kernel", subject, case.label, "declined", why)
        return
    args, kwargs = case.make()
    want = reference(*_clone(args), **_clone(kwargs))
    try:
        kernel = cls()
        got = kernel(*_to(args, target.device), **_to(kwargs, target.device))
    except Exception as exc:  # noqa: BLE001 - a claimed case that raises is a failure
        report.add("kernel", subject, case.label, "failed",
                   f"op {cls.op}, kernel {cls.name}: claimed {_fmt(case.problem)} but raised {type(exc).__name__}: {exc}")
        return
    with torch.no_grad():
        failure, detail = _compare(_held_to_compute_dtype(case, cls), got, want, target.interpreter)
    where = f"op {cls.op}, kernel {cls.name}, case {case.label}"
    report.add("kernel", subject, case.label, "failed" if failure else "passed", f"{where}: {detail}" if failure else detail)


def _held_to_compute_dtype(case: KernelCase, cls: type[Kernel]) -> KernelCase:
    """A kernel that declares it computes in a narrower dtype than its inputs (``capabilities()``
    ``compute_dtype``, e.g. bf16 matmuls for float32 activations) is held to that dtype's tolerance,
    and ``halserve plugins`` shows the declaration."""
    import dataclasses

    from halserve.plugins.testing.kernel_cases import TOLERANCE

    compute = cls.capabilities().get("compute_dtype")
    tol = TOLERANCE.get(str(compute), 0.0) * 2
    return dataclasses.replace(case, tol=tol) if tol > case.tol else case


def _clone(x: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, list):
        return [_clone(v) for v in x]
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def _to(x: Any, device: str) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        return x.clone().to(device)
    if isinstance(x, list):
        return [_to(v, device) for v in x]
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def _fmt(problem: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in problem.items())


def _tensors(x: Any) -> list:
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _compare(case: KernelCase, got: Any, want: Any, interpreter: bool) -> tuple[bool, str]:
    """(failed?, detail). Outputs are a tensor or a tuple of tensors (same arity as the reference)."""
    import torch

    got_list, want_list = _tensors(got), _tensors(want)
    if len(got_list) != len(want_list):
        return True, f"returned {len(got_list)} outputs, the reference returns {len(want_list)}"
    details = []
    for i, (g, w) in enumerate(zip(got_list, want_list)):
        name = f"output {i}" if len(want_list) > 1 else "output"
        if not isinstance(g, torch.Tensor):
            return True, f"{name} is a {type(g).__name__}, expected a tensor"
        g = g.detach().cpu()
        if tuple(g.shape) != tuple(w.shape) and not (case.compare.endswith("quant") and i == 1 and g.numel() == w.numel()):
            return True, f"{name} has shape {tuple(g.shape)}, expected {tuple(w.shape)}"
        if g.dtype != w.dtype and not (case.compare.endswith("quant") and i == 1):
            return True, f"{name} has dtype {g.dtype}, expected {w.dtype}"
        if case.compare == "fp8_quant" and i == 0:
            failed, detail = _compare_fp8_q(g, w, interpreter)
        elif case.compare == "int8_quant" and i == 0:
            failed, detail = _compare_int8_q(g, w)
        else:
            tol = case.tol if case.compare == "close" else 1e-5
            failed, detail = _compare_close(g.reshape(w.shape), w, tol)
        if failed:
            return True, f"{name}: {detail}"
        details.append(detail if len(want_list) == 1 else f"{name}: {detail}")
    return False, "; ".join(details)


def _compare_close(got, want, tol: float) -> tuple[bool, str]:
    import torch

    g, w = got.double(), want.double()
    if not bool(torch.isfinite(g).all()):
        return True, "contains NaN or inf"
    scale = max(w.abs().max().item(), 1e-6)
    err = (g - w).abs().max().item()
    rel = err / scale
    text = f"max |error| {err:.3g} = {rel:.2e} of max |ref| {scale:.3g} (tolerance {tol:.0e})"
    return rel > tol, text


def _compare_int8_q(got, want) -> tuple[bool, str]:
    diff = (got.long() - want.long()).abs()
    frac = (diff > 0).double().mean().item()
    worst = diff.max().item()
    text = f"{frac:.2%} of int8 values differ (max by {worst}; allowed: 1% by at most 1)"
    return worst > 1 or frac > 0.01, text


def _compare_fp8_q(got, want, interpreter: bool) -> tuple[bool, str]:
    g, w = got.float(), want.float()
    exact = g == w
    frac = 1.0 - exact.double().mean().item()
    allowed = FP8_QUANT_MISMATCH[interpreter]
    low = 0.5 if interpreter else 0.75  # interpreter casts drop a rounding carry; devices are within 1 ulp
    ratio = g[~exact] / w[~exact].where(w[~exact] != 0, 1e-30)
    bad_ratio = bool(((ratio < low) | (ratio > 1.25)).any()) if ratio.numel() else False
    text = f"{frac:.2%} of fp8 values differ from the reference (allowed {allowed:.0%}, each within [{low}, 1.25]x)"
    return frac > allowed or bad_ratio, text
