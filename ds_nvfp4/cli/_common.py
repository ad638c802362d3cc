"""What every subcommand does with bad input: one line on stderr naming the command, exit status 2."""

from __future__ import annotations

import sys


def bad_input(command: str, exc: Exception) -> int:
    print(f"ds-nvfp4 {command}: {exc}", file=sys.stderr)
    return 2
