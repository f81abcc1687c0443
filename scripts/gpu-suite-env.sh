#!/usr/bin/env bash
# On the GPU machine: install what scripts/gpu-suite-carry.sh packed, without
# touching the machine's own Python environment, and print the variables
# `make gpu-test` and `make bench-gpu` run under. Idempotent per folder.
#   gpu-suite-env.sh gantry   (from .gpuw1): a venv (GANTRY_GPU_VENV, default /root/gv) over the
#                              machine's python3 site-packages, with numpy 1.26 before its numpy 2
#                              (the python-backend stub is built for numpy 1), and redis-server
#   gpu-suite-env.sh triton   (from .gpuw2): tritonserver, the lock's transformers stack, and
#                              AIPerf (in its own folder, on the machine's numpy 2, behind a
#                              wrapper GANTRY_AIPERF points at)
#   gpu-suite-env.sh env      the exports, to eval
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${GANTRY_GPU_VENV:-/root/gv}
base=$(python3 -c 'import sys; print(sys.executable)')
site="$venv/lib/python3.12/site-packages"
case "${1:?gantry, triton or env}" in
  gantry)
    [ -d "$site" ] || python3 -m venv --without-pip "$venv"
    # The machine's packages (torch, transformers, ...) after the venv's own.
    python3 -c 'import site; print(site.getsitepackages()[0])' > "$site/machine-packages.pth"
    tar -xJf .gpuw1/gantry.tar.xz -C "$site" --strip-components=1
    mkdir -p /root/redis
    for deb in .gpuw1/*.deb; do dpkg -x "$deb" /root/redis; done
    ;;
  triton)
    tar -xJf .gpuw2/triton.tar.xz -C "$site"
    tar -xJf .gpuw2/hf.tar.xz -C "$site" --strip-components=1
    # Wheels added beside the archives since they were packed.
    for wheel in .gpuw2/*.whl; do [ -e "$wheel" ] && python3 -m zipfile -e "$wheel" "$site"; done
    mkdir -p /root/aiperf-site
    tar -xJf .gpuw2/aiperf.tar.xz -C /root/aiperf-site --strip-components=1
    printf '#!/bin/sh\nPYTHONPATH=/root/aiperf-site exec %s -c "import sys; from aiperf.cli import app; sys.exit(app())" "$@"\n' \
      "$base" > /root/aiperf && chmod +x /root/aiperf
    ;;
  env)
    echo "export PATH=/root/redis/usr/bin:$venv/bin:\$PATH"
    echo "export LD_LIBRARY_PATH=/root/redis/usr/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
    echo "export GPU_PYTHON=$venv/bin/python GANTRY_AIPERF=/root/aiperf HF_HUB_OFFLINE=1"
    echo "export GANTRY_GPU_SUITE_TOKENIZER=$PWD/.gpuw1/tokenizer"
    ;;
esac
