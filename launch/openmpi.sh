#!/usr/bin/env bash
# Multi-node training over Open MPI, two ways:
#   MODE=launcher HOSTFILE=hosts launch/openmpi.sh [train.py args]   # deepspeed --launcher openmpi
#   MODE=mpirun   HOSTFILE=hosts NP=4 launch/openmpi.sh [args]        # plain mpirun; ranks from OMPI_COMM_WORLD_*
# Environment: HOSTFILE (required), CONFIG, SCRIPT, NP (mpirun mode: total ranks; default: sum of slots),
# GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (also used for --mca btl_tcp_if_include), MASTER_ADDR, MASTER_PORT,
# MPI_ARGS (extra mpirun arguments). mpirun mode without MASTER_ADDR/PORT needs mpi4py (pip install '.[mpi]').
set -euo pipefail
source "$(dirname "$0")/common.sh"

MODE=${MODE:-launcher}
check_hostfile "${HOSTFILE:-}"
need_cmd mpirun "apt-get install openmpi-bin"
check_ssh "$HOSTFILE"
iface=${GLOO_SOCKET_IFNAME:-${NCCL_SOCKET_IFNAME:-}}
check_iface "$iface" "$HOSTFILE"
env_check_hosts "$HOSTFILE"
master=$(hosts_of "$HOSTFILE" | head -n 1)
# Open MPI as root needs --allow-run-as-root; pick the interface ourselves (DeepSpeed would add eth0, which may not
# exist: two hosts then crash in MPI_Bcast)
mpi_args="--allow-run-as-root ${iface:+--mca btl_tcp_if_include $iface} ${MPI_ARGS:-}"
case "$MODE" in
  launcher)
    cmd=("$BIN/deepspeed" --hostfile "$HOSTFILE" --force_multi --launcher openmpi "--launcher_args=$mpi_args"
         --master_addr "${MASTER_ADDR:-$master}" --master_port "${MASTER_PORT:-$(free_port)}"
         "$SCRIPT" --deepspeed_config "$CONFIG" "$@") ;;
  mpirun)
    "$BIN/python" -c "import mpi4py" 2>/dev/null || die "mpi4py is not installed in $BIN (pip install '.[mpi]')"
    np=${NP:-$(grep -v -E '^\s*(#|$)' "$HOSTFILE" | sed -E 's/.*slots=([0-9]+).*/\1/' | awk '{s += $1} END {print s}')}
    mpi_hosts=$(mktemp)
    grep -v -E '^\s*(#|$)' "$HOSTFILE" > "$mpi_hosts"
    # Rendezvous: MASTER_ADDR/MASTER_PORT when you set them, else train.py asks mpi4py (rank 0's TCP store on its
    # GLOO_SOCKET_IFNAME address and an OS-assigned port, broadcast); DeepSpeed's own discovery would use port 29500.
    # shellcheck disable=SC2086
    cmd=(mpirun -np "$np" --hostfile "$mpi_hosts" $mpi_args
         ${MASTER_ADDR:+-x MASTER_ADDR="$MASTER_ADDR"} ${MASTER_PORT:+-x MASTER_PORT="$MASTER_PORT"}
         -x PATH -x PYTHONPATH="$REPO" -x OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
         ${GLOO_SOCKET_IFNAME:+-x GLOO_SOCKET_IFNAME} ${NCCL_SOCKET_IFNAME:+-x NCCL_SOCKET_IFNAME}
         ${DS_ACCELERATOR:+-x DS_ACCELERATOR} ${TORCH_EXTENSIONS_DIR:+-x TORCH_EXTENSIONS_DIR}
         "$BIN/python" "$SCRIPT" --deepspeed_config "$CONFIG" "$@") ;;
  *) die "MODE=$MODE: allowed values are launcher, mpirun" ;;
esac
echo "running: ${cmd[*]}"
exec "${cmd[@]}"
