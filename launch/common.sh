#!/usr/bin/env bash
# Shared checks for the job scripts: fail fast with a message that names the missing piece, never hang.
# Sourced by pdsh.sh, openmpi.sh, slurm.sbatch and pbs.sh.

REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
BIN=${BIN:-$REPO/.venv/bin}
SCRIPT=${SCRIPT:-$REPO/launch/train.py}
CONFIG=${CONFIG:-$REPO/ds_configs/nvfp4_zero3.json}
SSH_TIMEOUT=${SSH_TIMEOUT:-10}

die() { echo "error: $*" >&2; exit 1; }

need_cmd() { command -v "$1" >/dev/null 2>&1 || die "'$1' not found in PATH ($2)"; }

free_port() { "$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }

# hosts of a DeepSpeed hostfile ("host slots=N"), comments and blank lines skipped
hosts_of() { grep -v -E '^\s*(#|$)' "$1" | awk '{print $1}'; }

check_hostfile() {
  [ -n "${1:-}" ] || die "no hostfile given: set HOSTFILE=FILE (see launch/hostfile.example)"
  [ -s "$1" ] || die "hostfile '$1' is missing or empty; see launch/hostfile.example"
  grep -v -E '^\s*(#|$)' "$1" | grep -q -v -E '^\S+\s+slots=[0-9]+\s*$' \
    && die "hostfile '$1': every line must read 'HOST slots=N' (DeepSpeed's format)"
  return 0
}

check_ssh() {  # every host reachable without a password, within SSH_TIMEOUT seconds
  local h
  for h in $(hosts_of "$1"); do
    timeout $((SSH_TIMEOUT + 5)) ssh -o BatchMode=yes -o ConnectTimeout="$SSH_TIMEOUT" "$h" true 2>/dev/null \
      || die "host '$h' is unreachable by passwordless ssh within ${SSH_TIMEOUT}s (check keys, sshd, the hostfile)"
  done
}

check_iface() {  # the socket interface exists on every host (gloo/NCCL bind to it)
  local iface=$1 hostfile=$2 h
  [ -n "$iface" ] || return 0
  for h in $(hosts_of "$hostfile"); do
    timeout $((SSH_TIMEOUT + 5)) ssh -o BatchMode=yes -o ConnectTimeout="$SSH_TIMEOUT" "$h" \
      "ip link show $iface" >/dev/null 2>&1 || die "interface '$iface' not found on host '$h' (GLOO_SOCKET_IFNAME)"
  done
}

write_deepspeed_env() {  # pdsh ranks only see PYTHON*/UCX*/... plus this file: no blank lines allowed in it
  local out=$1
  {
    echo "PATH=$BIN:$PATH"
    echo "PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}"
    echo "TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}"
    echo "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}"
    [ -n "${GLOO_SOCKET_IFNAME:-}" ] && echo "GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME"
    [ -n "${NCCL_SOCKET_IFNAME:-}" ] && echo "NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME"
    [ -n "${DS_ACCELERATOR:-}" ] && echo "DS_ACCELERATOR=$DS_ACCELERATOR"
  } > "$out"
}

env_check_local() {  # "is FP4 actually running?" answered before nodes are used: exit 1 stops the job
  "$BIN/ds-nvfp4" env --config "$CONFIG" || die "ds-nvfp4 env says $CONFIG cannot run on $(hostname)"
}
