#!/usr/bin/env bash
# The Triton image Gantry's docker tests run: no registry is reachable, so it
# is made here from a Debian root file system (debootstrap) with python3 and
# numpy, tritonserver from the nvidia-pytriton wheel laid out as in NVIDIA's
# images (/opt/tritonserver/{bin,backends,lib}), and the python backend's
# model dependencies (torch CPU, transformers, sentence-transformers) from the pinned lock.
# The tag carries a hash of its inputs: an existing image is reused.
# Usage: build-triton-test-image.sh PYTHON   (prints the image tag)
set -euo pipefail
PY=${1:?usage: $0 PYTHON}
cd "$(dirname "$0")/.."
model_deps='^(torch|transformers|llguidance|sentence-transformers|tokenizers|safetensors|huggingface[_-]hub|numpy|nvidia-pytriton)=='
inputs=$( (cat scripts/build-triton-test-image.sh scripts/debootstrap-bookworm.sh; grep -E "$model_deps" requirements.lock) | sha256sum | cut -c1-12)
tag="gantry/tritonserver-test:$inputs"
if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "$tag"; exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root="$work/rootfs"
scripts/debootstrap-bookworm.sh "$root" python3,python3-numpy,libpython3.11
dist=$("$PY" -c 'import pytriton, pathlib; print(pathlib.Path(pytriton.__file__).parent / "tritonserver")')
mkdir -p "$root/opt/tritonserver/lib"
cp -a "$dist/bin" "$dist/backends" "$dist/caches" "$root/opt/tritonserver/"
cp -a "$dist/../../nvidia_pytriton.libs/." "$root/opt/tritonserver/lib/"
cp "$dist/python_backend_stubs/3.11/triton_python_backend_stub" "$root/opt/tritonserver/backends/python/"
echo "installing the python backend's model dependencies" >&2
grep -E "$model_deps" requirements.lock | grep -v nvidia-pytriton > "$work/model-deps.txt"
"$PY" -m pip install -q --disable-pip-version-check --no-compile --target "$root/usr/local/lib/python3.11/dist-packages" \
  -c requirements.lock -r "$work/model-deps.txt" >&2
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/opt/tritonserver/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LD_LIBRARY_PATH=/opt/tritonserver/lib' \
  --change 'ENV HF_HUB_OFFLINE=1' \
  --change 'CMD ["tritonserver", "--help"]' \
  - "$tag" >/dev/null
# Earlier builds are 1.4 GB each: keep only this one.
docker images gantry/tritonserver-test --format '{{.Repository}}:{{.Tag}}' | grep -vx "$tag" | xargs -r docker rmi >/dev/null 2>&1 || true
echo "$tag"
