#!/usr/bin/env bash
# A local stand-in for the product image's bases (Dockerfile: PYTHON_BASE and
# NODE_BASE), where no registry is reachable: a Debian root file system
# (debootstrap, from the Debian mirror this machine uses) with Python 3.11 in a
# virtual environment first on PATH (as python and pip), a C compiler, and this
# machine's own Node.js and npm (Debian's npm does not configure under
# debootstrap). The tag carries a hash of this script and of that node: an
# existing image is reused.
# Usage: build-python-base-image.sh   (prints the image tag)
set -euo pipefail
cd "$(dirname "$0")/.."
node=$(command -v node) || { echo "node is not installed (make frontend installs it)" >&2; exit 1; }
npm_dir=$(cd "$(dirname "$(readlink -f "$(command -v npm)")")/.." && pwd)
tag="gantry/python-base:$( (cat scripts/build-python-base-image.sh scripts/debootstrap-bookworm.sh /etc/ssl/certs/ca-certificates.crt; "$node" --version) | sha256sum | cut -c1-12)"
if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "$tag"; exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root="$work/rootfs"
scripts/debootstrap-bookworm.sh "$root" python3,python3-venv,libpython3.11,ca-certificates,gcc,libc6-dev,g++
chroot "$root" python3 -m venv /opt/python >&2
install -m 0755 "$(readlink -f "$node")" "$root/usr/local/bin/node"
mkdir -p "$root/usr/local/lib/node_modules"
cp -a "$npm_dir" "$root/usr/local/lib/node_modules/npm"
ln -s ../lib/node_modules/npm/bin/npm-cli.js "$root/usr/local/bin/npm"
# This machine's trust (its CA bundle may hold a proxy's own CA) for pip and npm in the build.
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
rm -rf "$root/var/cache/apt/archives/"*.deb "$root/var/lib/apt/lists/"*
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt PIP_CERT=/etc/ssl/certs/ca-certificates.crt NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt' \
  --change 'CMD ["python"]' \
  - "$tag" >/dev/null
docker images gantry/python-base --format '{{.Repository}}:{{.Tag}}' | grep -vx "$tag" | xargs -r docker rmi >/dev/null 2>&1 || true
echo "$tag"
