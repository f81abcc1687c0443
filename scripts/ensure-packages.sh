#!/usr/bin/env bash
# Install Debian packages whose main command is missing: ensure-packages.sh PACKAGE...
# (the package's command is looked up under the same name, e.g. redis-server).
set -euo pipefail
missing=()
for pkg in "$@"; do
  command -v "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
