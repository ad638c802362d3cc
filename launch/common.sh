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

# on_every_host HOSTFILE TIMEOUT CMD: CMD on every host at once over ssh (a 64-node job must not wait for 64 checks
# in a row), each within TIMEOUT seconds; each host's output kept in $HOST_OUT/<host>, and FAILED_HOSTS set to the
# hosts whose command failed or timed out (in hostfile order). The caller words the error.
on_every_host() {
  local hostfile=$1 limit=$2 cmd=$3 h
  HOST_OUT=$(mktemp -d -t ds-nvfp4-hosts.XXXXXX)
  FAILED_HOSTS=()
  for h in $(hosts_of "$hostfile"); do
    ( timeout "$limit" ssh -o BatchMode=yes -o ConnectTimeout="$SSH_TIMEOUT" "$h" "$cmd" > "$HOST_OUT/$h" 2>&1
      echo $? > "$HOST_OUT/$h.rc" ) &
  done
  wait
  for h in $(hosts_of "$hostfile"); do
    [ "$(cat "$HOST_OUT/$h.rc" 2>/dev/null)" = 0 ] || FAILED_HOSTS+=("$h")
  done
}

# one error line per failed host (MESSAGE with HOST replaced by the host's name), then exit 1
die_for_failed_hosts() {
  local message=$1 h
  [ ${#FAILED_HOSTS[@]} -eq 0 ] && { rm -rf "$HOST_OUT"; return 0; }
  for h in "${FAILED_HOSTS[@]}"; do echo "error: ${message//HOST/$h}" >&2; done
  rm -rf "$HOST_OUT"
  exit 1
}

check_ssh() {  # every host reachable without a password, within SSH_TIMEOUT seconds
  on_every_host "$1" $((SSH_TIMEOUT + 5)) true
  die_for_failed_hosts "host 'HOST' is unreachable by passwordless ssh within ${SSH_TIMEOUT}s (check keys, sshd, the hostfile)"
}

check_iface() {  # the socket interface exists on every host (gloo/NCCL bind to it)
  local iface=$1 hostfile=$2
  [ -n "$iface" ] || return 0
  on_every_host "$hostfile" $((SSH_TIMEOUT + 5)) "ip link show $iface"
  die_for_failed_hosts "interface '$iface' not found on host 'HOST' (GLOO_SOCKET_IFNAME)"
}

# "is FP4 actually running?" answered on every host before any is used: the first host's whole report, one
# verdict line per other host, the whole report of any host that fails (exit 1 stops the job)
env_check_hosts() {
  local hostfile=$1 h first
  on_every_host "$hostfile" 300 "cd $REPO && $BIN/ds-nvfp4 env --config $CONFIG"
  first=$(hosts_of "$hostfile" | head -n 1)
  sed "s/^/$first: /" "$HOST_OUT/$first"
  for h in $(hosts_of "$hostfile" | tail -n +2); do
    if [[ " ${FAILED_HOSTS[*]} " == *" $h "* ]]; then sed "s/^/$h: /" "$HOST_OUT/$h"
    else echo "$h: $(grep -a -E '^\s*config ' "$HOST_OUT/$h" | tail -n 1 | sed -E 's/^\s+//')"; fi
  done
  die_for_failed_hosts "ds-nvfp4 env says $CONFIG cannot run on HOST (its report above)"
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
