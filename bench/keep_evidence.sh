#!/usr/bin/env bash
# Copy what docs/results.md cites from an evidence directory (runs/ is not committed) into docs/evidence/NAME:
# per run config.json, probe.json / finetune.json / final_eval.json when present and metrics.jsonl and
# summary.json (gzipped); per comparison report.md, report.json and report.png; the lines of wall_times.txt for
# runs not kept yet. Checkpoints stay in runs/.
#   bash bench/keep_evidence.sh runs/evidence_5m 5m
set -euo pipefail
src=$1; dest=docs/evidence/$2
mkdir -p "$dest"
for run in "$src"/*/; do
  name=$(basename "$run")
  if [ -f "$run/summary.json" ]; then
    mkdir -p "$dest/$name"
    for f in config.json probe.json finetune.json final_eval.json; do
      # absolute paths of the machine that ran it become repository-relative
      [ -f "$run/$f" ] && sed -E 's#"/[^"]*/(runs|launch|data)/#"\1/#g' "$run/$f" > "$dest/$name/$f"
    done
    gzip -9 -n -c "$run/metrics.jsonl" > "$dest/$name/metrics.jsonl.gz"
    gzip -9 -n -c "$run/summary.json" > "$dest/$name/summary.json.gz"  # per-rank losses: large
  elif [ -f "$run/report.json" ]; then
    mkdir -p "$dest/$name"
    cp "$run"/report.png "$dest/$name/"
    for f in report.md report.json; do sed -E 's#(["`])/[^"`]*/(runs|launch|data)/#\1\2/#g' "$run/$f" > "$dest/$name/$f"; done
  fi
done
if [ -f "$src/wall_times.txt" ]; then
  # only runs not listed yet are appended: the notes written by hand on kept lines (what shared the machine, the
  # parts of a resumed run) stay
  touch "$dest/wall_times.txt"
  while read -r name rest; do
    grep -q "^$name " "$dest/wall_times.txt" || echo "$name $rest" >> "$dest/wall_times.txt"
  done < "$src/wall_times.txt"
fi
du -sh "$dest"
