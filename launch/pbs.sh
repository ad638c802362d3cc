#!/usr/bin/env bash
#PBS -N ds-nvfp4
#PBS -l nodes=2:ppn=1
#PBS -l walltime=01:00:00
#PBS -j oe
# PBS/Torque job: `qsub launch/pbs.sh` (train.py arguments through TRAIN_ARGS="...", passed with qsub -V or -v).
# Turns $PBS_NODEFILE into a DeepSpeed hostfile and runs launch/pdsh.sh (deepspeed --hostfile). Under SLURM's PBS
# wrappers (Debian slurm-wlm-torque: qsub over sbatch), which set no PBS_NODEFILE, the node list comes from
# SLURM_JOB_NODELIST instead. Environment: CONFIG, SCRIPT, REPO, GLOO/NCCL_SOCKET_IFNAME.
set -euo pipefail
REPO=${REPO:-${PBS_O_WORKDIR:-${SLURM_SUBMIT_DIR:-$(pwd)}}}
source "$REPO/launch/common.sh"

if [ -z "${PBS_NODEFILE:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  need_cmd scontrol "SLURM client tools"
  PBS_NODEFILE=$(mktemp)
  for h in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
    for _ in $(seq "${SLURM_NTASKS_PER_NODE:-1}"); do echo "$h"; done
  done > "$PBS_NODEFILE"
  echo "no PBS_NODEFILE (SLURM's qsub wrapper): node file from SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
fi
[ -n "${PBS_NODEFILE:-}" ] && [ -s "$PBS_NODEFILE" ] || die "PBS_NODEFILE is not set or empty: submit with qsub"
HOSTFILE=$(mktemp)
# PBS lists a node once per slot; first-seen order kept (the first node is the master)
awk '!n[$1]++ {order[++k] = $1} {c[$1]++} END {for (i = 1; i <= k; i++) print order[i] " slots=" c[order[i]]}' \
  "$PBS_NODEFILE" > "$HOSTFILE"
export HOSTFILE
echo "hostfile from PBS_NODEFILE:"
sed 's/^/  /' "$HOSTFILE"
# shellcheck disable=SC2086
exec bash "$REPO/launch/pdsh.sh" ${TRAIN_ARGS:-}
