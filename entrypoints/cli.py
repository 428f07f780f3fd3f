"""The ``halserve`` command. Each subcommand lives in its own module exposing
``add_parser(subparsers)`` (which sets ``func`` on its parser) so this file stays small."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand name -> module (imported only to build the parser; heavy imports stay in run)
SUBCOMMANDS = {
    "serve": "halserve.entrypoints.cli_serve",
    "plugins": "halserve.entrypoints.cli_plugins",
    "bench": "halserve.entrypoints.cli_bench",
    "conformance": "halserve.entrypoints.cli_conformance",
    "proxy": "halserve.entrypoints.cli_proxy",
}


def build_parser() -> argparse.ArgumentParser:
    from halserve import __version__
    from halserve.entrypoints.vllm_flags import SuggestingArgumentParser

    parser = SuggestingArgumentParser(
        prog="halserve",
        description="LLM serving on any accelerator through plugins.",
    )
    parser.add_argument("--version", action="version", version=f"halserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue  # subcommand not built in this version
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    logging.basicConfig(
        level=getattr(logging, str(getattr(args, "log_level", "warning")).upper(), logging.WARNING),
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
