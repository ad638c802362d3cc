#!/usr/bin/env bash
# The main job of the README's Quick start (`make demo`). Until the reference training lands this runs the
# format demo and the quantize benchmark; the command name stays the same when it becomes the training demo.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
$PY -m ds_nvfp4 quantize-demo --dist cauchy
$PY -m pip install -q torchao --no-deps
$PY bench/quantize.py
