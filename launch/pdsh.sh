#!/usr/bin/env bash
# Multi-node training with DeepSpeed's default launcher (pdsh over ssh):
#   HOSTFILE=hosts launch/pdsh.sh [train.py args...]
# Environment: HOSTFILE (required), CONFIG (default ds_configs/nvfp4_zero3.json), SCRIPT (launch/train.py),
# NUM_GPUS (per node; default: the hostfile's slots), GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, MASTER_PORT.
set -euo pipefail
source "$(dirname "$0")/common.sh"

check_hostfile "${HOSTFILE:-}"
need_cmd pdsh "apt-get install pdsh"
check_ssh "$HOSTFILE"
check_iface "${GLOO_SOCKET_IFNAME:-${NCCL_SOCKET_IFNAME:-}}" "$HOSTFILE"
generated_env=
if [ -z "${DS_ENV_FILE:-}" ]; then  # pdsh ranks see only this file's variables (plus PYTHON*): generate one
  DS_ENV_FILE=$(mktemp -t ds-nvfp4-env.XXXXXX)
  generated_env=1
  trap 'rm -f "$DS_ENV_FILE"' EXIT  # a check below may stop the script
  write_deepspeed_env "$DS_ENV_FILE"
fi
[ -s "$DS_ENV_FILE" ] || die "DS_ENV_FILE=$DS_ENV_FILE is missing or empty"
grep -q -E '^\s*$' "$DS_ENV_FILE" && die "DS_ENV_FILE=$DS_ENV_FILE has a blank line (DeepSpeed's parser breaks on it)"
export DS_ENV_FILE
echo "environment for the ranks ($DS_ENV_FILE):"
sed 's/^/  /' "$DS_ENV_FILE"
env_check_hosts "$HOSTFILE"   # the environment check on every node at once, before training starts
port=${MASTER_PORT:-$(free_port)}
cmd=("$BIN/deepspeed" --hostfile "$HOSTFILE" --master_port "$port" "$SCRIPT" --deepspeed_config "$CONFIG" "$@")
[ -n "${NUM_GPUS:-}" ] && cmd=("$BIN/deepspeed" --hostfile "$HOSTFILE" --num_gpus "$NUM_GPUS" --master_port "$port"
  "$SCRIPT" --deepspeed_config "$CONFIG" "$@")
echo "running: ${cmd[*]}"
[ -z "$generated_env" ] && exec "${cmd[@]}"
# The generated file is removed when the launcher ends, however it ends: it runs as a child (the launcher reads the
# file only when it starts); SIGTERM, SIGINT and SIGHUP are passed on to it (a child started with & ignores SIGINT)
"${cmd[@]}" &
launcher=$!
trap 'kill -TERM "$launcher" 2>/dev/null' TERM INT HUP
status=0
wait "$launcher" || status=$?
while kill -0 "$launcher" 2>/dev/null; do wait "$launcher" || status=$?; done
exit "$status"
