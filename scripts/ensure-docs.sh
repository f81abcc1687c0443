#!/usr/bin/env bash
# Install the documentation site's builder (mkdocs-material, pinned by
# docs.lock) in its own virtual environment, .docs/, so its pins never meet
# Gantry's. Idempotent: does nothing while the environment is newer than the lock.
set -euo pipefail
cd "$(dirname "$0")/.."
target=.docs
python="${PYTHON:-python3}"
stamp="$target/.installed-stamp"
[ -f "$stamp" ] && [ "$stamp" -nt docs.lock ] && exit 0
test -x "$target/bin/python" || "$python" -m venv "$target"
"$target/bin/python" -m pip install --disable-pip-version-check -q -r docs.lock
touch "$stamp"
