#!/usr/bin/env bash
# The acceptance evidence of docs/results.md: BF16, the mission recipe and the paper recipe trained for the same
# number of steps on the Shakespeare text (2 CPU ranks, ZeRO-3), each compared with BF16 by `ds-nvfp4 compare`.
# Then the downstream check: each pretrained run fine-tuned on WordNet supersenses with the same seeds
# (FINETUNE_STEPS=0 skips it; needs Debian's wordnet-base).
#   MODEL=5m STEPS=2100 OUT=runs/evidence bash bench/evidence.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
MODEL=${MODEL:-5m}
STEPS=${STEPS:-2100}
OUT=${OUT:-runs/evidence_$MODEL}
EVAL=${EVAL:-100}
export OMP_NUM_THREADS=1
"$BIN/python" -m ds_nvfp4 data
mkdir -p "$OUT"
for run in bf16:bf16_zero3 mission:nvfp4_zero3 paper:nvfp4_full_zero3; do
  name=${run%%:*}
  [ -f "$OUT/$name/summary.json" ] && { echo "== $name: done already ($OUT/$name)"; continue; }
  port=$("$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  start=$(date +%s)
  "$BIN/deepspeed" --num_gpus 2 --master_port "$port" launch/train.py --deepspeed_config "ds_configs/${run#*:}.json" \
    --model "$MODEL" --steps "$STEPS" --eval-interval "$EVAL" --eval-batches 32 --ckpt-interval "$STEPS" \
    --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$name $(( $(date +%s) - start )) s" | tee -a "$OUT/wall_times.txt"
done
FINETUNE_STEPS=${FINETUNE_STEPS:-400}
SEEDS=${SEEDS:-0 1 2 3}
if [ "$FINETUNE_STEPS" -gt 0 ]; then
  export OMP_NUM_THREADS=${FINETUNE_THREADS:-2}  # one process: use both cores
  for name in bf16 mission paper; do
    [ -f "$OUT/$name/finetune.json" ] && { echo "== $name: fine-tuned already"; continue; }
    start=$(date +%s)
    # shellcheck disable=SC2086
    "$BIN/python" -m ds_nvfp4 finetune "$OUT/$name" --task wordnet --seeds $SEEDS --steps "$FINETUNE_STEPS" \
      > "$OUT/$name.finetune.log" 2>&1
    tail -n 1 "$OUT/$name.finetune.log"
    echo "$name finetune $(( $(date +%s) - start )) s" | tee -a "$OUT/wall_times.txt"
  done
fi
for name in mission paper; do
  "$BIN/python" -m ds_nvfp4 compare "$OUT/bf16" "$OUT/$name" --out "$OUT/report_$name" || true
done
