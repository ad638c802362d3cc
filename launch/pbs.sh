#!/usr/bin/env bash
#PBS -N ds-nvfp4
#PBS -l nodes=2:ppn=1
#PBS -l walltime=01:00:00
#PBS -j oe
# PBS/Torque job: `qsub launch/pbs.sh` (arguments through TRAIN_ARGS="..."). Turns $PBS_NODEFILE into a DeepSpeed
# hostfile and runs launch/pdsh.sh (deepspeed --hostfile). Environment: CONFIG, SCRIPT, REPO, GLOO/NCCL_SOCKET_IFNAME.
set -euo pipefail
REPO=${REPO:-${PBS_O_WORKDIR:-$(pwd)}}
source "$REPO/launch/common.sh"

[ -n "${PBS_NODEFILE:-}" ] && [ -s "$PBS_NODEFILE" ] || die "PBS_NODEFILE is not set or empty: submit with qsub"
HOSTFILE=$(mktemp)
sort "$PBS_NODEFILE" | uniq -c | awk '{print $2" slots="$1}' > "$HOSTFILE"
export HOSTFILE
echo "hostfile from PBS_NODEFILE:"
cat "$HOSTFILE"
# shellcheck disable=SC2086
exec bash "$REPO/launch/pdsh.sh" ${TRAIN_ARGS:-}
