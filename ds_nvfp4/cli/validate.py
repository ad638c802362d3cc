"""`ds-nvfp4 validate FILE...`: every problem of every ds_config, one per line; exit 0/1/2."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from ..config import ConfigError, UnreadableConfig, check_config, read_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check ds_config files (the precision section, cross-checks, DeepSpeed's "
                                        "own models)", description="Exit 0: all valid; 1: some invalid (an unknown "
                                        "top-level key that looks like a known one counts, unless --allow-unknown); "
                                        "2: usage error or unreadable file.")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--json", action="store_true", help="print a machine-readable result")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing when every file is valid")
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's own config models (faster)")
    p.add_argument("--allow-unknown", action="store_true",
                   help="report unknown top-level keys that look like known ones (e.g. 'precison') as warnings "
                        "instead of errors")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    results = []
    status = 0
    for path in args.files:
        entry: dict = {"file": path, "valid": False, "readable": True, "problems": []}
        ds = None
        try:
            ds = read_json(path)
            _, problems = check_config(ds, deepspeed_checks=not args.no_deepspeed)
        except UnreadableConfig as exc:
            entry["readable"] = False
            entry["problems"] = [{"path": "(file)", "message": str(exc), "allowed": [], "severity": "error"}]
            results.append(entry)
            status = 2
            continue
        except ConfigError as exc:
            problems = exc.problems
        problems = list(problems) + (_base_checkpoint_problems(ds) if isinstance(ds, dict) else [])
        if not args.allow_unknown:  # a near miss trains silently without what it meant: an error here
            problems = [replace(p, severity="error", message=p.message + " (--allow-unknown to accept it)")
                        if p.code == "near-miss" else p for p in problems]
        entry["problems"] = [p.to_dict() for p in problems]
        entry["valid"] = not any(p.severity == "error" for p in problems)
        entry["_lines"] = [p.format(path) for p in problems]
        if not entry["valid"]:
            status = max(status, 1)
        results.append(entry)

    if args.json:
        clean = [{k: v for k, v in r.items() if not k.startswith("_")} for r in results]
        print(json.dumps({"valid": status == 0, "exit_code": status, "files": clean}, indent=2))
        return status
    for r in results:
        if not r["readable"]:
            print(r["problems"][0]["message"], file=sys.stderr)
            continue
        for line in r["_lines"]:
            print(line, file=sys.stdout if r["valid"] else sys.stderr)
        if r["valid"] and not args.quiet:
            print(f"{r['file']}: ok")
    return status


def _base_checkpoint_problems(ds: dict) -> list:
    """``precision.base.checkpoint`` names a folder: check it as a fine-tune will load it (configs, headers and
    global scales only), so a bad checkpoint stops here, before any job starts."""
    from ..checkpoint import CheckpointError
    from ..checkpoint.hf_nvfp4 import open_nvfp4_checkpoint
    from ..config import Problem

    section = ds.get("precision")
    base = section.get("base") if isinstance(section, dict) else None
    folder = base.get("checkpoint") if isinstance(base, dict) else None
    if not isinstance(folder, str) or not section.get("enabled"):
        return []
    try:
        open_nvfp4_checkpoint(folder)
    except CheckpointError as exc:
        return [Problem("precision.base.checkpoint", str(exc))]
    return []
