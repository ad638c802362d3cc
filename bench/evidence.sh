#!/usr/bin/env bash
# The acceptance evidence of docs/results.md: BF16 and every shipped NVFP4 preset (plus the ablations) trained for
# the same number of steps on the Shakespeare text (2 CPU ranks), each compared with BF16 by `ds-nvfp4 compare`;
# the deterministic downstream check (`ds-nvfp4 probe`) on BF16, the default preset and the second BF16 seed;
# optionally the seed-noisy WordNet fine-tunes. Runs already finished (summary.json present) are skipped, so an
# interrupted script resumes.
#   MODEL=5m STEPS=2100 OUT=runs/evidence_5m bash bench/evidence.sh
#   MODEL=1m STEPS=2100 OUT=runs/evidence_1m RUNS="bf16 nvfp4_zero3" PROBE_RUNS= bash bench/evidence.sh
#   MODEL=10m STEPS=2100 OUT=runs/evidence_10m RUNS="bf16 nvfp4_zero3" PROBE_RUNS= bash bench/evidence.sh
#   FINAL_EVAL_BATCHES=600 MODEL=10m OUT=runs/evidence_10m RUNS="..." PROBE_RUNS= bash bench/evidence.sh
#     (finished runs re-evaluated on the whole validation split, then compared again)
#   python bench/gap_vs_size.py runs/evidence_{1m,5m,10m}/report_nvfp4_zero3 \
#     --out docs/results_gap_vs_size.png --json docs/results_gap_vs_size.json
# Wall times (this 2-core machine, 2100 steps, alone unless said): 5m ~19 min BF16, ~29 min per forward-only NVFP4
# preset, ~60-70 min per paper-preset run (FP4 backward; two side by side); the whole default list ~6.5 h, resumable;
# 10m ~40 min BF16, ~70 min NVFP4; each probe (all of WordNet) ~30 min at 5m. On a 2-core AMD EPYC (AVX512-BF16, no
# AMX), alone: 10m 28 min BF16, 30-33 min per forward-only NVFP4 preset, ~50 min paper preset. Per-run times:
# OUT/wall_times.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
MODEL=${MODEL:-5m}
STEPS=${STEPS:-2100}
# a reference protocol of ds_nvfp4/evaluation/protocol.py (e.g. v2): it sets the steps, batch, schedule and
# evaluations (STEPS and EVAL are then unused) and evaluates the whole validation split after the last step
PROTOCOL=${PROTOCOL:-}
OUT=${OUT:-runs/evidence_$MODEL}
EVAL=${EVAL:-100}
RUNS=${RUNS:-bf16 nvfp4_zero3 nvfp4_zero2 nvfp4_zero3_offload nvfp4_full_zero3 all_blocks all_blocks_late15 paper_late15
           paper_no_warmup warmup50 bf16_seed1}
PROBE_RUNS=${PROBE_RUNS-bf16 nvfp4_zero3 bf16_seed1}  # PROBE_RUNS= (empty): no probe
FINAL_EVAL_BATCHES=${FINAL_EVAL_BATCHES:-0}  # 600: re-evaluate every run's last checkpoint (see below)
FINETUNE_STEPS=${FINETUNE_STEPS:-0}   # 400 with SEEDS="0 1 2 3": ~4.5 min per seed and run
SEEDS=${SEEDS:-0 1 2 3}
# a checkpoint every CKPT steps (the newest 2 kept): an interrupted run resumes from it (--resume) instead of
# starting again; hours-long runs (30M) span sessions
CKPT=${CKPT:-100}
export OMP_NUM_THREADS=1

# NAME_seedN: the run NAME with --seed N (initialization and batch order; the validation windows stay fixed), e.g.
# bf16_seed1 against bf16 measures the noise floor of one run per recipe
seed_of() { case $1 in *_seed*) echo "${1##*_seed}" ;; *) echo 0 ;; esac; }
config_of() {
  case ${1%_seed*} in
    bf16) echo ds_configs/bf16_zero3.json ;;
    # BF16 with the optimizer offloaded as nvfp4_zero3_offload.json does it (DeepSpeed's CPU Adam instead of
    # torch's): the baseline that differs from the offload preset in precision alone
    bf16_offload) echo bench/configs/bf16_zero3_offload.json ;;
    all_blocks) echo ds_configs/nvfp4_zero3_all_blocks_ablation.json ;;
    # the late switch as a fraction needs the run's length: this config is written for 2,100 steps
    all_blocks_late15) echo bench/configs/nvfp4_zero3_all_blocks_late_bf16_2100.json ;;
    # the paper preset with the late switch (written for 2,100 steps), and as it was before its BF16 warm-up
    paper_late15) echo bench/configs/nvfp4_full_zero3_warmup50_late15_2100.json ;;
    paper_no_warmup) echo bench/configs/nvfp4_full_zero3_no_warmup.json ;;
    # the default preset with the late switch: forward GEMMs BF16 for the last 15% (written for 2,100 steps)
    late15) echo bench/configs/nvfp4_zero3_late15_2100.json ;;
    # the same for protocol v3's 1,200 steps (the 1M candidate after the default failed there: docs/results.md)
    late15_1200) echo bench/configs/nvfp4_zero3_late15_1200.json ;;
    # the default preset with 4/6 block scaling of the weights (precision.weights.scaling "4over6", bound 256); the
    # 5M run was made with the preset before the guard (BF16 warm-up: its config.json in docs/evidence/5m)
    four_over_six) echo bench/configs/nvfp4_zero3_4over6.json ;;
    # the loss-spike guard in place of the BF16 warm-up, run under this name before the presets took it (the kept
    # runs' config.json name bench/configs/nvfp4_zero3_spike_guard.json, the same contents): the default preset
    spike_guard) echo ds_configs/nvfp4_zero3.json ;;
    # the default preset before the switch to the guard: FP4 off for the first 50 steps (the 10M fix)
    warmup50) echo bench/configs/nvfp4_zero3_bf16_warmup50.json ;;
    # an MoE recipe candidate (issue 35): the default preset with the last 2 blocks BF16 in place of the last 15%
    # (of moe-5m's 6 blocks: blocks 1-3 FP4, where the default has 1-4)
    moe_last2) echo bench/configs/nvfp4_zero3_moe_last2.json ;;
    *) echo "ds_configs/${1%_seed*}.json" ;;
  esac
}
# launch/train.py on 2 ranks as run NAME (its config and seed; a free port), appending to OUT/NAME.log; with
# PROTOCOL the protocol's batch, steps, schedule and evaluations instead of STEPS and EVAL
recipe() {
  if [ -n "$PROTOCOL" ]; then echo --protocol "$PROTOCOL"; else echo --steps "$STEPS"; fi
}
train_py() {
  local name=$1 port
  shift
  port=$("$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  # shellcheck disable=SC2046
  "$BIN/deepspeed" --num_gpus 2 --master_port "$port" launch/train.py --deepspeed_config "$(config_of "$name")" \
    --model "$MODEL" $(recipe) --seed "$(seed_of "$name")" --out "$OUT/$name" "$@" >> "$OUT/$name.log" 2>&1
}

# A pair's two runs must run on one machine type: CPUs of other types run other GEMM kernels, whose rounding differs
# from the first step (docs/results.md, "One machine type, several instances, the same bits"). Before any training,
# each run still to do is checked against the runs of OUT it will be compared with (a twin copied from docs/evidence
# included); ALLOW_OTHER_MACHINE=1 trains anyway (the report then says the machines differ); CHECK_ONLY=1 stops
# after this check.
machine_of() {  # "CPU model (BF16 GEMM units)" of run directory $1, or of this machine without an argument
  "$BIN/python" - "$@" <<'PY'
import json, sys
from pathlib import Path
if len(sys.argv) > 1:
    m = json.loads((Path(sys.argv[1]) / "config.json").read_text()).get("machine") or {}
else:
    from ds_nvfp4.envcheck import machine
    m = machine()
print(f"{m.get('name', 'not recorded')} ({m.get('bf16_gemm', '?')})")
PY
}
partners() {  # the runs of OUT that run $1 will be paired with
  local name=$1 d
  case $name in
    bf16_seed*) for d in "$OUT"/*_seed"${name#bf16_seed}"; do
                  case $(basename "$d") in bf16*) ;; *) [ -f "$d/config.json" ] && basename "$d" ;; esac
                done ;;
    bf16) ;;
    *_seed*) echo "bf16_seed$(seed_of "$name")" ;;
    *) echo bf16 ;;
  esac
}
here=$(machine_of)
for name in $RUNS; do
  [ -f "$OUT/$name/summary.json" ] && continue
  for twin in $(partners "$name"); do
    [ -f "$OUT/$twin/config.json" ] || continue
    there=$(machine_of "$OUT/$twin")
    if [ "$there" != "$here" ] && [ "${ALLOW_OTHER_MACHINE:-0}" != 1 ]; then
      echo "bench/evidence.sh: $name would be paired with $OUT/$twin, which ran on $there; this machine is $here." >&2
      echo "  A pair's runs must share a machine type (their BF16 GEMMs round differently): run both here (move" >&2
      echo "  $OUT/$twin aside), or set ALLOW_OTHER_MACHINE=1 to train anyway." >&2
      exit 2
    fi
  done
done
[ "${CHECK_ONLY:-0}" = 1 ] && { echo "bench/evidence.sh: every pair of RUNS can run on this machine ($here)"; exit 0; }

"$BIN/python" -m ds_nvfp4 data
mkdir -p "$OUT"
for name in $RUNS; do
  [ -f "$OUT/$name/summary.json" ] && { echo "== $name: done already ($OUT/$name)"; continue; }
  case $name in *late15) [ "$STEPS" = 2100 ] || { echo "== $name: needs STEPS=2100, skipped"; continue; } ;; esac
  # a resumed run's time below is this part's only
  part=""; [ -d "$OUT/$name/ckpt" ] && part=" (resumed from its newest checkpoint: this part only)"
  start=$(date +%s)
  if [ -n "$PROTOCOL" ]; then  # the protocol fixes the evaluations, the final whole-split one included
    train_py "$name" --ckpt-interval "$CKPT" --keep-ckpts 2 --resume
  else
    train_py "$name" --eval-interval "$EVAL" --eval-batches 32 --ckpt-interval "$CKPT" --keep-ckpts 2 --resume
  fi
  echo "$name $(( $(date +%s) - start )) s$part" | tee -a "$OUT/wall_times.txt"
done
# every finished run's last checkpoint evaluated again on FINAL_EVAL_BATCHES held-out batches (final_eval.json,
# which compare then judges): 600 is ~the whole validation split at --seq 256, a paired interval ~4.3x narrower
# than the training's 32 batches (~1.5 min per 10M run). Only for every run of OUT alike, never one pair alone.
if [ "$FINAL_EVAL_BATCHES" -gt 0 ]; then
  for name in $RUNS; do
    [ -f "$OUT/$name/summary.json" ] || continue
    grep -q "\"eval_batches\": $FINAL_EVAL_BATCHES," "$OUT/$name/final_eval.json" 2>/dev/null \
      && { echo "== $name: re-evaluated already"; continue; }
    start=$(date +%s)
    train_py "$name" --eval-batches "$FINAL_EVAL_BATCHES" --final-eval
    echo "$name/final_eval $(( $(date +%s) - start )) s ($FINAL_EVAL_BATCHES batches)" | tee -a "$OUT/wall_times.txt"
  done
fi
export OMP_NUM_THREADS=${EVAL_THREADS:-2}  # one process: use both cores
for name in $PROBE_RUNS; do
  [ -f "$OUT/$name/probe.json" ] && { echo "== $name: probed already"; continue; }
  "$BIN/python" -m ds_nvfp4 probe "$OUT/$name" | tee -a "$OUT/wall_times.txt"
done
if [ "$FINETUNE_STEPS" -gt 0 ]; then
  for name in $PROBE_RUNS; do
    [ -f "$OUT/$name/finetune.json" ] && { echo "== $name: fine-tuned already"; continue; }
    start=$(date +%s)
    # shellcheck disable=SC2086
    "$BIN/python" -m ds_nvfp4 finetune "$OUT/$name" --task wordnet --seeds $SEEDS --steps "$FINETUNE_STEPS" \
      > "$OUT/$name.finetune.log" 2>&1
    echo "$name finetune $(( $(date +%s) - start )) s" | tee -a "$OUT/wall_times.txt"
  done
fi
for name in $RUNS; do
  [ "$name" = bf16 ] || [ ! -f "$OUT/$name/summary.json" ] && continue
  # bf16_seedN is judged against bf16 (seed 0): the same recipe twice, the noise floor; any other NAME_seedN
  # against bf16_seedN, the BF16 run of its own seed
  case $name in
    # (a seed set has no plain bf16 run: then there is no noise-floor report to write)
    bf16_seed*) [ -f "$OUT/bf16/summary.json" ] || continue
                "$BIN/python" -m ds_nvfp4 compare "$OUT/bf16" "$OUT/$name" --seeds-may-differ \
                  --out "$OUT/report_$name" || true ;;
    *_seed*) "$BIN/python" -m ds_nvfp4 compare "$OUT/bf16_seed$(seed_of "$name")" "$OUT/$name" \
               --out "$OUT/report_$name" || true ;;
    *) "$BIN/python" -m ds_nvfp4 compare "$OUT/bf16" "$OUT/$name" --out "$OUT/report_$name" || true ;;
  esac
  # the offload preset also against its BF16 twin of the same seed (same CPU Adam) when that was run: the pair that
  # differs in precision alone
  case $name in
    nvfp4_zero3_offload*)
      twin=bf16_offload${name#nvfp4_zero3_offload}
      [ -f "$OUT/$twin/summary.json" ] && { "$BIN/python" -m ds_nvfp4 compare "$OUT/$twin" "$OUT/$name" \
                                              --out "$OUT/report_${name}_vs_$twin" || true; } ;;
  esac
done
