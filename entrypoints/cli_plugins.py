"""``halserve plugins``: what was discovered, what failed and why, which platform runs.

    halserve plugins                  readable tables
    halserve plugins --json           one JSON object (shape below, stable)
    halserve plugins --platform rocm  resolve kernels/attention for that platform

JSON keys: ``api_version``, ``plugins``, ``platforms``, ``attention_backends``,
``kernels``, ``quant_methods``, ``kv_connectors``, ``executors``, ``models``, ``load_formats``,
``selected_platform`` (+ ``selected_platform_error``), ``resolved_for``,
``resolved_kernels`` ({op: kernel name | null}), ``resolution_errors`` ({op: reason}),
``kernels_skipped`` ({op: ["name: reason", ...]}: kernels passed over before the chosen one),
``resolved_attention_backend`` (+ ``attention_backend_error``, ``attention_backend_skipped``,
``attention_problem``: the representative layer it was resolved for), (plugin API 2)
``layer_overrides`` ([{platform, replaces, replaces_class, cls, plugin}]), ``model_variants``
([{architecture, platform, target, plugin, replaces, replaces_plugin}]), ``resolved_layers``
({built-in class: replacement} on the resolved platform), ``resolved_models`` ({architecture:
implementation} on the resolved platform).

Exit status: 0, including when a plugin failed (it is shown, not fatal); 1 when
HALSERVE_PLUGINS / HALSERVE_DISABLE_PLUGINS name an unknown plugin or two plugins
register the same name.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from halserve.platforms.base import Platform
    from halserve.plugins.manager import PluginManager

# Representative problem per op, used to show what each op resolves to. The dtype is
# filled in per platform ("act" = the platform's default dtype, "fp8" = its fp8 flavour).
_PROBLEMS: dict[str, dict[str, Any]] = {
    "gemm": {"dtype": "act", "n": 4096, "k": 4096},
    "fp8_scaled_gemm": {"dtype": "fp8", "fp8_dtype": "fp8", "n": 4096, "k": 4096},
    "int8_scaled_gemm": {"dtype": "int8", "n": 4096, "k": 4096},
    "scaled_fp8_quant": {"dtype": "act", "fp8_dtype": "fp8"},
    "scaled_int8_quant": {"dtype": "act"},
    "per_token_group_fp8_quant": {"dtype": "act", "fp8_dtype": "fp8", "group_size": 128},
    "fp8_block_scaled_gemm": {"dtype": "fp8", "fp8_dtype": "fp8", "n": 4096, "k": 7168,
                              "block_size": (128, 128)},  # (DeepSeek-V3)
    "awq_gemm": {"dtype": "act", "n": 4096, "k": 4096, "group_size": 128},
    "gptq_gemm": {"dtype": "act", "n": 4096, "k": 4096, "group_size": 128},
    "rms_norm": {"dtype": "act", "hidden_size": 4096},
    "rotary_embedding": {"dtype": "act", "head_size": 128, "rotary_dim": 128, "is_neox": True},
    "silu_and_mul": {"dtype": "act", "intermediate_size": 11008},
    "gelu_tanh_and_mul": {"dtype": "act", "intermediate_size": 9216},  # (Gemma 2 9B)
    "fused_moe": {"dtype": "act", "num_experts": 8, "top_k": 2, "hidden_size": 4096,
                  "intermediate_size": 14336},  # (Mixtral 8x7B)
}
# Unknown problem keys of a future op get a plausible size.
_DEFAULT_PROBLEM_VALUE = 128
# Representative attention configuration (a Llama-style layer).
_ATTENTION_PROBLEM = {"head_size": 128, "block_size": 16, "num_heads": 32, "num_kv_heads": 8}

_KINDS = ("attention_backends", "kernels", "quant_methods", "kv_connectors", "executors", "models", "load_formats")


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plugins",
        help="list plugins, platforms, backends and kernels, and what resolves where",
        description="Show what halserve discovered: plugins (and why any failed), platforms "
        "(and why each is or is not available), attention backends, kernels (and which one each "
        "op resolves to on the selected platform), quant methods, KV connectors, executors, models.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument(
        "--platform",
        default=None,
        metavar="P",
        help="resolve kernels and attention for platform P (default: HALSERVE_PLATFORM, else auto-detect)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from halserve.plugins import PluginConflictError, PluginSelectionError, get_plugin_manager

    try:
        manager = get_plugin_manager()
        manager.check_conflicts()
    except (PluginSelectionError, PluginConflictError) as exc:
        print(f"halserve plugins: error: {exc}", file=sys.stderr)
        return 1
    report = collect(manager, args.platform)
    text = json.dumps(report, indent=2, default=str) if args.json else render(report)
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `halserve plugins | head`: the reader left, not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


# -- collecting ----------------------------------------------------------------------
def collect(manager: PluginManager, platform: str | None = None) -> dict[str, Any]:
    """The whole report as JSON-able data (what ``--json`` prints)."""
    from halserve.plugins import API_VERSION

    report: dict[str, Any] = {"api_version": API_VERSION}
    report["plugins"] = [
        {**record.to_json(), "traceback": record.traceback} for record in manager.records
    ]

    selected, selected_error = _select(platform)
    report["platforms"] = _platform_rows(manager, selected)
    for kind in _KINDS:
        report[kind] = _rows(manager, kind)
    report["selected_platform"] = selected
    from halserve.models.transformers_backend import backend_status

    report["transformers_backend"] = backend_status()  # (architectures with no native code: issue 28)
    report["selected_platform_error"] = selected_error

    # Resolve for the selected platform; when an explicitly named platform is registered
    # but not available here, still show what it would use.
    target = selected
    if target is None and platform and manager.platforms.get(platform) is not None:
        target = platform
    report["resolved_for"] = target
    report["layer_overrides"] = _layer_override_rows(manager)  # (plugin API 2)
    report["model_variants"] = _model_variant_rows(manager)
    kernels, errors, kernels_skipped = _resolve_kernels(manager, target)
    report["resolved_kernels"] = kernels
    report["resolution_errors"] = errors
    report["kernels_skipped"] = kernels_skipped
    backend, skipped, problem = _resolve_attention(manager, target)
    report["resolved_attention_backend"] = backend
    report["attention_backend_error"] = None if backend else "; ".join(skipped)
    report["attention_backend_skipped"] = skipped if backend else []  # preferred ones passed over
    report["attention_problem"] = problem
    report["resolved_layers"] = {  # built-in class -> what models build on the target platform
        r["replaces"]: r["cls"] for r in report["layer_overrides"] if r["platform"] == target
    }
    report["resolved_models"] = {  # architecture -> the implementation the target platform gets
        r["name"]: next((v["target"] for v in report["model_variants"]
                         if v["architecture"] == r["name"] and v["platform"] == target), r["target"])
        for r in report["models"]
    }
    return report


def _qualname(cls: Any) -> str:
    return f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else str(cls)


def _layer_override_rows(manager: PluginManager) -> list[dict[str, Any]]:
    registry = getattr(manager, "layer_overrides", None) or ()
    return sorted(
        ({"platform": reg.obj.platform, "replaces": reg.obj.replaces.__name__,
          "replaces_class": _qualname(reg.obj.replaces), "cls": _qualname(reg.obj.cls), "plugin": reg.plugin}
         for reg in registry),
        key=lambda r: (r["platform"], r["replaces"]),
    )


def _model_variant_rows(manager: PluginManager) -> list[dict[str, Any]]:
    registry = getattr(manager, "model_variants", None) or ()
    rows = []
    for reg in registry:
        platform, _, arch = reg.name.partition("/")
        builtin = manager.models.get(arch)
        rows.append({"architecture": arch, "platform": platform, "target": _qualname(reg.obj.target),
                     "plugin": reg.plugin, "replaces": None if builtin is None else _qualname(builtin.obj),
                     "replaces_plugin": None if builtin is None else builtin.plugin})
    return sorted(rows, key=lambda r: (r["architecture"], r["platform"]))


def _select(platform: str | None) -> tuple[str | None, str | None]:
    from halserve.platforms import resolve_platform

    try:
        return resolve_platform(platform).name, None
    except Exception as exc:  # noqa: BLE001 - shown to the user, never fatal here
        return None, f"{type(exc).__name__}: {exc}"


def _platform_rows(manager: PluginManager, selected: str | None) -> list[dict[str, Any]]:
    from halserve.plugins.registry import describe

    rows = []
    for reg in manager.platforms:
        probe = reg.obj.probe()
        rows.append(
            {
                **describe(reg.obj),
                "name": reg.name,
                "plugin": reg.plugin,
                "available": probe.available,
                "reason": probe.reason,
                "priority": getattr(reg.obj, "priority", 0),
                "device_type": getattr(reg.obj, "device_type", None),
                "selected": reg.name == selected,
            }
        )
    rows.sort(key=lambda r: (-r["priority"], r["name"]))
    return rows


def _rows(manager: PluginManager, kind: str) -> list[dict[str, Any]]:
    from halserve.plugins.registry import describe

    rows = []
    for reg in manager.registries[kind]:
        if kind == "models":
            rows.append({"name": reg.name, "plugin": reg.plugin, "target": str(reg.obj)})
            continue
        row = {"platforms": list(getattr(reg.obj, "platforms", ("*",))), **describe(reg.obj)}
        row["name"] = getattr(reg.obj, "name", reg.name)
        row["plugin"] = reg.plugin
        if kind == "kernels":
            row["op"] = reg.obj.op
            row["key"] = reg.name  # "<op>/<name>", the registry's unique name
        rows.append(row)
    if kind == "kernels":
        rows.sort(key=lambda r: (r["op"], -r.get("priority", 0), r["name"]))
    return rows


def _problem(op: str, platform_cls: type[Platform]) -> dict[str, Any]:
    from halserve.kernels import OPS

    default = getattr(platform_cls, "default_dtype", "float32")
    fp8 = getattr(platform_cls, "fp8_dtype", None) or "float8_e4m3fn"
    keys = {"dtype": "act", **{k: _DEFAULT_PROBLEM_VALUE for k in OPS[op].problem_keys}}
    problem = {**keys, **_PROBLEMS.get(op, {})}
    return {k: default if v == "act" else fp8 if v == "fp8" else v for k, v in problem.items()}


def _resolve_kernels(
    manager: PluginManager, platform: str | None
) -> tuple[dict[str, str | None], dict[str, str], dict[str, list[str]]]:
    """({op: kernel | None}, {op: why none}, {op: ["name: reason", ...] of the kernels passed over
    before the chosen one})."""
    from halserve.kernels import OPS, kernel_candidates

    kernels: dict[str, str | None] = {op: None for op in OPS}
    errors: dict[str, str] = {}
    skipped: dict[str, list[str]] = {}
    if platform is None:
        return kernels, {op: "no platform selected" for op in OPS}, skipped
    platform_cls = manager.platforms[platform].obj
    for op in OPS:
        problem = _problem(op, platform_cls)
        reasons = []
        for cls in kernel_candidates(op, platform):
            try:
                reason = cls.supports(**problem)
            except Exception as exc:  # noqa: BLE001 - a broken supports() is a reason
                reason = f"supports() raised {type(exc).__name__}: {exc}"
            if reason is None:
                kernels[op] = cls.name
                if reasons:
                    skipped[op] = reasons
                break
            reasons.append(f"{cls.name}: {reason}")
        else:
            where = ", ".join(f"{k}={v}" for k, v in problem.items())
            errors[op] = (
                f"no kernel supports {where}: " + "; ".join(reasons)
                if reasons
                else f"no kernel for {op} is registered for platform {platform}"
            )
    return kernels, errors, skipped


def _resolve_attention(manager: PluginManager, platform: str | None) -> tuple[str | None, list[str], dict[str, Any]]:
    """(backend name | None, reasons the platform's earlier preferences were passed over, problem)."""
    if platform is None:
        return None, ["no platform selected"], {}
    platform_cls = manager.platforms[platform].obj
    problem = {"dtype": getattr(platform_cls, "default_dtype", "float32"), **_ATTENTION_PROBLEM}
    reasons = []
    for name in getattr(platform_cls, "preferred_attention_backends", ()):
        reg = manager.attention_backends.get(name)
        if reg is None:
            reasons.append(f"{name}: not registered")
            continue
        if not reg.obj.runs_on(platform):
            reasons.append(f"{name}: does not run on {platform}")
            continue
        try:
            reason = reg.obj.supports(**problem)
        except Exception as exc:  # noqa: BLE001
            reason = f"supports() raised {type(exc).__name__}: {exc}"
        if reason is None:
            return name, reasons, problem
        reasons.append(f"{name}: {reason}")
    return None, reasons or [f"platform {platform} prefers no attention backend"], problem


# -- rendering -----------------------------------------------------------------------
def _table(headers: list[str], rows: list[list[Any]], indent: str = "  ") -> str:
    cells = [[str(c) for c in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, indent + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _list(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) or "-"
    return "-" if value is None else str(value)


def render(report: dict[str, Any]) -> str:
    """The readable form of ``collect``'s report."""
    out: list[str] = [f"halserve plugin API {report['api_version']}", ""]

    out.append("Plugins")
    out.append(
        _table(
            ["name", "status", "version", "api", "distribution", "error"],
            [[p["name"], p["status"], p["version"], p["api"], p["distribution"], p["error"]] for p in report["plugins"]],
        )
    )
    for p in report["plugins"]:
        for w in p.get("warnings") or []:
            out.append(f"  plugin {p['name']!r} warning: {w}")
        if p["status"] == "failed" and p.get("traceback"):
            out.append(f"\n  plugin {p['name']!r} failed:")
            out.extend("    " + line for line in p["traceback"].rstrip().splitlines())

    out += ["", "Platforms (* = selected)"]
    out.append(
        _table(
            ["", "name", "available", "priority", "device", "dtypes", "graphs", "plugin", "reason"],
            [
                ["*" if r["selected"] else "", r["name"], "yes" if r["available"] else "no", r["priority"],
                 r["device_type"], _list(r.get("supported_dtypes")), r.get("graph_mode", "eager"), r["plugin"],
                 r["reason"]]
                for r in report["platforms"]
            ],
        )
    )
    if report["selected_platform"] is None:
        out.append(f"  no platform selected: {report['selected_platform_error']}")

    target = report["resolved_for"]
    out += ["", "Attention backends"]
    out.append(
        _table(
            ["name", "platforms", "dtypes", "head sizes", "block sizes", "kv cache", "plugin"],
            [
                [r["name"], _list(r.get("platforms")), _list(r.get("dtypes")), _list(r.get("head_sizes")),
                 _list(r.get("block_sizes")), _list(r.get("kv_cache_dtypes")), r["plugin"]]
                for r in report["attention_backends"]
            ],
        )
        if report["attention_backends"]
        else "  (none registered)"
    )
    if target is not None:
        chosen = report["resolved_attention_backend"] or f"none ({report['attention_backend_error']})"
        where = ", ".join(f"{k}={v}" for k, v in report["attention_problem"].items())
        out.append(f"  on {target} ({where}): {chosen}")
        for reason in report["attention_backend_skipped"]:
            out.append(f"    passed over {reason}")

    out += ["", f"Kernels (resolved on {target or 'no platform'})"]
    from halserve.kernels import OPS  # noqa: PLC0415 - cheap, and only when rendering

    by_op: dict[str, list[dict[str, Any]]] = {}
    for k in report["kernels"]:
        by_op.setdefault(k["op"], []).append(k)
    for op in list(OPS) + sorted(set(by_op) - set(OPS)):
        resolved = report["resolved_kernels"].get(op)
        shown = resolved or f"none ({report['resolution_errors'].get(op, 'unresolved')})"
        out.append(f"  {op} -> {shown}")
        for reason in report.get("kernels_skipped", {}).get(op, []):
            out.append(f"    passed over {reason}")
        for k in by_op.get(op, []):
            out.append(
                f"      {k['name']}  platforms={_list(k.get('platforms'))}  priority={k.get('priority')}  "
                f"dtypes={_list(k.get('dtypes'))}  plugin={k['plugin']}"
            )

    for kind, title in (
        ("quant_methods", "Quantization methods"),
        ("kv_connectors", "KV connectors"),
        ("executors", "Executors"),
        ("load_formats", "Load formats (--load-format; besides halserve's auto, safetensors, dummy)"),
    ):
        out += ["", title]
        rows = report[kind]
        out.append(
            _table(["name", "platforms", "plugin"], [[r["name"], _list(r.get("platforms")), r["plugin"]] for r in rows])
            if rows
            else "  (none registered)"
        )
    out += ["", "Models"]
    out.append(
        _table(["architecture", "implementation", "plugin"], [[r["name"], r["target"], r["plugin"]] for r in report["models"]])
        if report["models"]
        else "  (none registered)"
    )
    tb = report.get("transformers_backend")
    if tb:
        out.append("  other architectures: the Transformers modeling backend (" + (
            f"transformers {tb['transformers_version']}; {tb['serves']}" if tb["available"] else
            f"unavailable: {tb['reason']}") + ")")
    for v in report.get("model_variants", []):
        out.append(f"  {v['architecture']} on {v['platform']}: {v['target']} (plugin {v['plugin']}, overrides "
                   f"{v['replaces'] or 'nothing registered'})")
    out += ["", "Layer overrides (plugin API 2; * = applies on the resolved platform)"]
    rows = report.get("layer_overrides", [])
    out.append(
        _table(["", "platform", "replaces", "with", "plugin"],
               [["*" if r["platform"] == target else "", r["platform"], r["replaces"], r["cls"], r["plugin"]]
                for r in rows])
        if rows
        else "  (none registered: every platform builds the built-in layers)"
    )
    return "\n".join(out)
