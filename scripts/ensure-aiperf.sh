#!/usr/bin/env bash
# Install the load generator (NVIDIA AIPerf, from PyPI) in its own virtual
# environment, pinned by aiperf.lock, so its dependencies never meet Gantry's.
# Load tests run it on each GPU host's worker (GANTRY_AIPERF points at it).
# Idempotent: does nothing while the environment is newer than the lock.
# Usage: scripts/ensure-aiperf.sh [folder]   (default .aiperf/ in the checkout)
set -euo pipefail
cd "$(dirname "$0")/.."
target="${1:-.aiperf}"
python="${PYTHON:-python3}"
stamp="$target/.installed-stamp"
[ -f "$stamp" ] && [ "$stamp" -nt aiperf.lock ] && exit 0
test -x "$target/bin/python" || "$python" -m venv "$target"
"$target/bin/python" -m pip install --disable-pip-version-check -q -r aiperf.lock
"$target/bin/aiperf" --version > /dev/null
touch "$stamp"
