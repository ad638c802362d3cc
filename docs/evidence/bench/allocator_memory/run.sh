#!/usr/bin/env bash
# 3 invocations per benchmark and allocator setting, alternating, beside the MoE evidence run
set -u
cd "$(dirname "$0")/../../../.."
for i in 1 2 3; do
  for bench in experts gemm; do
    for setting in default reuse; do
      if [ $setting = reuse ]; then E="MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736"; else E=""; fi
      env $E .venv/bin/python bench/$bench.py --repeats 5 --json docs/evidence/bench/allocator_memory/${bench}_${setting}_$i.json \
        > docs/evidence/bench/allocator_memory/${bench}_${setting}_$i.txt 2>&1
      echo "$(date +%T) $bench $setting $i rc=$?"
    done
  done
done
