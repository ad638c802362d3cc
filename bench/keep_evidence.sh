#!/usr/bin/env bash
# Copy what docs/results.md cites from an evidence directory (runs/ is not committed) into docs/evidence/NAME:
# per run config.json, probe.json / finetune.json when present and metrics.jsonl and summary.json (gzipped); per
# comparison report.md, report.json and report.png; wall_times.txt. Checkpoints stay in runs/.
#   bash bench/keep_evidence.sh runs/evidence_5m 5m
set -euo pipefail
src=$1; dest=docs/evidence/$2
mkdir -p "$dest"
for run in "$src"/*/; do
  name=$(basename "$run")
  if [ -f "$run/summary.json" ]; then
    mkdir -p "$dest/$name"
    for f in config.json probe.json finetune.json; do
      [ -f "$run/$f" ] && cp "$run/$f" "$dest/$name/"
    done
    gzip -9 -n -c "$run/metrics.jsonl" > "$dest/$name/metrics.jsonl.gz"
    gzip -9 -n -c "$run/summary.json" > "$dest/$name/summary.json.gz"  # per-rank losses: large
  elif [ -f "$run/report.json" ]; then
    mkdir -p "$dest/$name"
    cp "$run"/report.md "$run"/report.json "$run"/report.png "$dest/$name/"
  fi
done
[ -f "$src/wall_times.txt" ] && cp "$src/wall_times.txt" "$dest/"
du -sh "$dest"
