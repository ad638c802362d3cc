#!/usr/bin/env bash
# The README Quick start's main job (`make demo`): a ~1M-parameter GPT on Shakespeare with 2 CPU ranks under
# DeepSpeed ZeRO-3, first the BF16 baseline, then NVFP4 (the mission's recipe), then the acceptance report.
# STEPS=... and MODEL=... override the defaults; the runs land in runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
STEPS=${STEPS:-200}
MODEL=${MODEL:-1m}
OUT=${OUT:-runs/demo}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# glibc keeps freed buffers for reuse instead of page-faulting them in again: faster, same bits (docs/benchmarks.md,
# CPU allocator)
export MALLOC_MMAP_MAX_=${MALLOC_MMAP_MAX_-0} MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_-68719476736}

"$BIN/python" -m ds_nvfp4 data
# the C++ CPU format kernels are built once per machine (~1 min the first time, then cached by torch)
"$BIN/python" -c 'from ds_nvfp4.format import _cpu_ext; _cpu_ext.extension()'
port=$("$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
for run in bf16:bf16_zero3 nvfp4:nvfp4_zero3; do
  name=${run%%:*}
  preset=${run#*:}
  echo "== $name: $MODEL model, $STEPS steps, 2 ranks, ds_configs/$preset.json"
  rm -rf "${OUT:?}/$name"  # a fresh run directory: a stale summary.json must not hide a failed run
  "$BIN/deepspeed" --num_gpus 2 --master_port "$port" launch/train.py \
    --deepspeed_config "ds_configs/$preset.json" --model "$MODEL" --steps "$STEPS" --eval-interval 50 \
    --out "$OUT/$name" || true
  test -f "$OUT/$name/summary.json" || { echo "the $name run did not finish (see above)" >&2; exit 1; }
done
rc=0
"$BIN/python" -m ds_nvfp4 compare "$OUT/bf16" "$OUT/nvfp4" --out "$OUT" || rc=$?
# 0 pass, 1 fail, 3 inconclusive are all answers; 2 means the runs could not be compared
[ "$rc" -ne 2 ] || exit 2
echo "report: $OUT/report.md   plot: $OUT/report.png   runs: $OUT/bf16 $OUT/nvfp4"
