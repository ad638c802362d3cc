#!/usr/bin/env bash
# Debian packages the multi-host tests (tests/cluster/) need. Run by `make test`; idempotent, a no-op when they are
# installed. Without root or apt-get it installs nothing and those tests skip, saying why.
set -euo pipefail
PKGS="iproute2 util-linux openssh-server openssh-client pdsh openmpi-bin libopenmpi-dev slurm-wlm munge slurm-wlm-torque"
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "tests/cluster/setup.sh: not root or no apt-get: the multi-host tests will skip"
  exit 0
fi
missing=$(for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done | xargs)
[ -z "$missing" ] && exit 0
echo "tests/cluster/setup.sh: apt-get install $missing"
export DEBIAN_FRONTEND=noninteractive
# shellcheck disable=SC2086
timeout 900 apt-get install -y -q --no-install-recommends $missing >/dev/null \
  || { timeout 600 apt-get update -q >/dev/null && timeout 900 apt-get install -y -q --no-install-recommends $missing >/dev/null; }
