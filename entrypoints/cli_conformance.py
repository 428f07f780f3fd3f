"""``halserve conformance PLUGIN``: run the conformance kit on an installed plugin.

    halserve conformance cpu                    readable capability matrix
    halserve conformance cuda --quick           trimmed grids (Triton interpreted on CPU without a GPU)
    halserve conformance myvendor --json        one JSON object: plugin, platform, summary, results
    halserve conformance builtin --platform cpu check ("*") kernels and backends as on platform cpu

Exit status: 0 when nothing failed (declined and warned cases are fine), 1 when a check
failed, 2 when the plugin or platform named does not exist.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "conformance",
        help="check a plugin's kernels, attention backends and platforms against the references",
        description="Run the conformance kit on one installed plugin (its entry-point name): every kernel "
        "against the op's torch reference over generated shapes and dtypes, every attention backend against "
        "the torch backend on mixed batches, every platform's declarations and config hooks, and greedy "
        "generation on a tiny random model against the CPU reference. Triton kernels of unavailable "
        "platforms run on the CPU under TRITON_INTERPRET=1 when there is no GPU.",
    )
    parser.add_argument("plugin", metavar="PLUGIN", help="entry-point name of the plugin (see `halserve plugins`)")
    parser.add_argument("--platform", default=None, metavar="P",
                        help="test kernels and backends on platform P (default: the plugin's own platform)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--quick", action="store_true", help="trimmed grids (a few cases per op and backend)")
    parser.add_argument("--checks", default=None, metavar="LIST",
                        help="comma-separated subset of: platforms, kernels, attention, e2e, layers, communicator, variants "
                        "(default: all)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from halserve.plugins import PluginSelectionError, get_plugin_manager
    from halserve.plugins.testing import CHECKS, ConformanceSetupError, prepare_interpreter, run_conformance

    checks = tuple(c.strip() for c in args.checks.split(",")) if args.checks else CHECKS
    try:
        manager = get_plugin_manager()
        if manager.record(args.plugin) is not None:
            prepare_interpreter(manager, args.plugin, args.platform)
        report = run_conformance(args.plugin, platform=args.platform, quick=args.quick, checks=checks,
                                 manager=manager)
    except (ConformanceSetupError, PluginSelectionError, RuntimeError) as exc:
        print(f"halserve conformance: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.table())
    return report.exit_code
