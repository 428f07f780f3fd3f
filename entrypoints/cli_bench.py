"""``halserve bench {throughput,serve}``: each benchmark is a module in ``halserve.bench``
exposing ``add_args(parser)`` and ``run(args) -> int``, imported only to build its parser."""
from __future__ import annotations

import argparse
import importlib
from typing import Any

BENCHMARKS = {
    "throughput": ("halserve.bench.throughput", "offline throughput of the engine (no server)"),
    "serve": ("halserve.bench.serve", "load-test a running OpenAI-compatible server (like vllm bench serve)"),
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmarks: throughput, serve", description="Benchmarks.")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    for name, (module, help_text) in BENCHMARKS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        bp = sub.add_parser(
            name, help=help_text, description=(mod.__doc__ or help_text).strip().splitlines()[0],
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        mod.add_args(bp)
        bp.set_defaults(func=mod.run)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    return p
