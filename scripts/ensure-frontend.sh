#!/usr/bin/env bash
# Install the pages' front-end packages (package.json, pinned by package-lock.json)
# and copy the files the pages load to static/vendor/. Idempotent: does nothing
# while static/vendor/ is newer than the lock file.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=static/vendor/.installed-stamp
[ -f "$stamp" ] && [ "$stamp" -nt package-lock.json ] && exit 0
scripts/ensure-packages.sh npm
npm ci --no-audit --no-fund --loglevel=error
mkdir -p static/vendor
cp node_modules/uplot/dist/uPlot.iife.min.js node_modules/uplot/dist/uPlot.min.css node_modules/uplot/LICENSE static/vendor/
touch "$stamp"
