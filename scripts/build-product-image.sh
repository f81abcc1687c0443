#!/usr/bin/env bash
# Build the product image (Dockerfile) where no registry is reachable: its
# bases are the local Python base (scripts/build-python-base-image.sh), and the
# CPU build of torch this machine carries goes into wheels/ so the build does
# not download the CUDA one. Docker's layer cache keeps the dependencies'
# layers while only Gantry's code changes.
# Usage: build-product-image.sh   (prints the image tag)
set -euo pipefail
cd "$(dirname "$0")/.."
base=$(scripts/build-python-base-image.sh)
for wheel in /opt/wheels/torch-*+cpu-cp311-*.whl; do
  [ -e "$wheel" ] && cp -n "$wheel" wheels/
done
tag="gantry/gantry:$(git rev-parse --short HEAD 2>/dev/null || echo local)"
DOCKER_BUILDKIT=0 docker build -q --network host \
  --build-arg PYTHON_BASE="$base" --build-arg NODE_BASE="$base" -t "$tag" . >&2
# Earlier builds: keep only this one.
docker images gantry/gantry --format '{{.Repository}}:{{.Tag}}' | grep -vx "$tag" | xargs -r docker rmi >/dev/null 2>&1 || true
echo "$tag"
