"""The files of a ``launch/train.py`` run directory, as written or as kept in docs/evidence (``metrics.jsonl`` and
``summary.json`` gzipped by bench/keep_evidence.sh): ``ds-nvfp4 compare`` reads either, so a kept seed set is
re-judged from the repository as it is."""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def run_file(run: Path, name: str) -> Path | None:
    """``run/name``, else ``run/name.gz``; None when neither exists."""
    for path in (run / name, run / f"{name}.gz"):
        if path.exists():
            return path
    return None


def read_text(run: Path, name: str) -> str:
    """The text of ``run/name`` or of its gzipped copy (FileNotFoundError naming ``run/name`` when neither exists)."""
    path = run_file(run, name)
    if path is None:
        raise FileNotFoundError(run / name)
    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()


def read_json(run: Path, name: str) -> dict:
    """``run/name`` (or ``name.gz``) parsed."""
    return json.loads(read_text(run, name))


def read_rows(run: Path, name: str = "metrics.jsonl") -> list[dict]:
    """The JSON lines of ``run/name`` (or ``name.gz``), blank lines skipped."""
    return [json.loads(ln) for ln in read_text(run, name).splitlines() if ln.strip()]
