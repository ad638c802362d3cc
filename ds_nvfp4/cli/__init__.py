"""The `ds-nvfp4` command line (also `python -m ds_nvfp4`).

Each subcommand lives in its own module exposing ``register(subparsers)``; ``main`` returns the exit
status. Exit codes follow one rule everywhere: 0 success, 1 the checked thing failed, 2 usage error or
unreadable input.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .._version import __version__

#: subcommand module names, in the order ``--help`` lists them
SUBCOMMANDS = ("env", "validate", "explain", "schema", "compare", "finetune", "probe", "export", "checkpoint", "merge",
               "data", "quantize_demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds-nvfp4", description="NVFP4 training under DeepSpeed ZeRO")
    parser.add_argument("--version", action="version", version=f"ds-nvfp4 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args) or 0)
