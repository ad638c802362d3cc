#!/usr/bin/env bash
# The GPU checks of ds-nvfp4 in one run on one CUDA device (a Hopper H200 has no FP4 tensor cores: the emulated
# path): bench/device_check.py (the emulated GEMM under its contract, NVFP4Linear vs BF16 Linear at LLM shapes, the
# grouped MoE experts bit for bit and against transformers' BF16 experts, packed ZeRO-3 on one rank). Wheels the
# device image lacks (pydantic, DeepSpeed built here as a pure-Python wheel) travel in .whl/ (git-ignored).
#   used as: device run, carry [".whl"], command "bash bench/gpu_check.sh"; results in $OUT
set -o pipefail
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 DS_NVFP4_CPU_EXT=0
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia_smi.txt"
python3 -c "import torch, deepspeed, pydantic; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'deepspeed', deepspeed.__version__, 'pydantic', pydantic.__version__)" | tee "$OUT/versions.txt"
timeout 420 python3 bench/device_check.py --json "$OUT/device_check.json" 2>&1 | tee "$OUT/device_check.log"
