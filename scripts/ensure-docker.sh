#!/usr/bin/env bash
# A Docker engine for Gantry's tests: installs Debian's docker.io when dockerd
# is missing, and starts dockerd without a bridge network or iptables rules
# (containers use host networking) when none answers. Idempotent.
set -euo pipefail
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
if ! command -v dockerd >/dev/null 2>&1; then
  echo "installing docker.io"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq docker.io >/dev/null
fi
if docker info >/dev/null 2>&1; then
  exit 0
fi
echo "starting dockerd"
mkdir -p /tmp/gantry-dockerd
$SUDO "$(dirname "$0")/detached.sh" dockerd --bridge=none --iptables=false --ip-masq=false \
  --pidfile /tmp/gantry-dockerd/dockerd.pid </dev/null >/tmp/gantry-dockerd/dockerd.log 2>&1 &
for _ in $(seq 1 100); do docker info >/dev/null 2>&1 && exit 0; sleep 0.2; done
echo "dockerd did not start; see /tmp/gantry-dockerd/dockerd.log" >&2
exit 1
