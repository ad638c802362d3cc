"""``ds-nvfp4 ARGS`` run in the test's own process: its exit status and what it printed, as the command line gives
them, without a fresh interpreter's seconds of importing torch (the suite calls the CLI ~100 times). The entry point
itself (``ds-nvfp4``, ``python -m ds_nvfp4``) is tested as a process in tests/cli/test_cli.py."""

from __future__ import annotations

import contextlib
import io
import subprocess

from ds_nvfp4.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``main(args)`` with stdout and stderr captured; ``returncode`` is its exit status (argparse's included)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse's usage errors and --help
            code = exit_.code if isinstance(exit_.code, int) else 2
    return subprocess.CompletedProcess(["ds-nvfp4", *args], code, out.getvalue(), err.getvalue())
