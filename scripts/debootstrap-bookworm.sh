#!/usr/bin/env bash
# A minimal Debian bookworm root file system in ROOT, from the Debian mirror
# this machine already uses, with PACKAGES (comma-separated) in it: the start
# of every image Gantry makes locally where no registry is reachable.
# Installs debootstrap when missing.
# Usage: debootstrap-bookworm.sh ROOT PACKAGES
set -euo pipefail
root=${1:?usage: $0 ROOT PACKAGES}
packages=${2:?usage: $0 ROOT PACKAGES}
command -v debootstrap >/dev/null || {
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq debootstrap >/dev/null
}
mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[ -n "$mirror" ] || mirror=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list)
echo "debootstrap bookworm from $mirror" >&2
log=$(mktemp)
debootstrap --variant=minbase --include="$packages" bookworm "$root" "$mirror" >"$log" 2>&1 \
  || { tail -20 "$log" >&2; rm -f "$log"; exit 1; }
rm -f "$log"
