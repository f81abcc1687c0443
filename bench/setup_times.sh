#!/usr/bin/env bash
# Cold set-up times (issue 29's report, not a benchmark with a target): each
# way of installing Gantry beside a plain `pip install django celery channels`
# timed in the same run, every pip without its cache. Prints seconds.
#   1. the floor: a fresh venv + pip install django celery channels
#   2. a fresh venv + pip install ".[worker]" (the lock as constraints)
#   3. from there, gantry demo until it says it is running (demo-stack then loads)
#   4. the product image with no layer cache (scripts/build-product-image.sh's build)
# Usage: bench/setup_times.sh   (needs redis-server and docker; takes ~10 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'kill $(cat "$work/demo.pid" 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
now() { date +%s.%N; }
took() { python3 -c "print(f'{$2 - $1:.1f}')"; }

t0=$(now); python3 -m venv "$work/floor" && "$work/floor/bin/pip" install -q --no-cache-dir django celery channels; t1=$(now)
echo "floor: venv + pip install django celery channels: $(took "$t0" "$t1") s"

git archive --prefix=src/ HEAD | tar -x -C "$work"  # pip builds in the tree it installs: not in the checkout
t0=$(now); python3 -m venv "$work/gantry" && "$work/gantry/bin/pip" install -q --no-cache-dir -c requirements.lock "$work/src[worker]"; t1=$(now)
echo "venv + pip install .[worker]: $(took "$t0" "$t1") s"

port=$(python3 -c "import random; print(random.randrange(20000, 30000, 10))")
t0=$(now)
GANTRY_DATA_DIR="$work/data" GANTRY_AIPERF="$PWD/.aiperf/bin/aiperf" setsid "$work/gantry/bin/gantry" demo --port "$port" \
  > "$work/demo.log" 2>&1 & echo $! > "$work/demo.pid"
until grep -q "Gantry is running" "$work/demo.log"; do
  kill -0 "$(cat "$work/demo.pid")" 2>/dev/null || { tail -20 "$work/demo.log"; exit 1; }
  sleep 0.5
done
t1=$(now)
echo "gantry demo, first start until running: $(took "$t0" "$t1") s"
kill -INT -- -"$(cat "$work/demo.pid")"; wait "$(cat "$work/demo.pid")" 2>/dev/null || true

base=$(scripts/build-python-base-image.sh)
t0=$(now)
DOCKER_BUILDKIT=0 docker build -q --no-cache --network host --build-arg PYTHON_BASE="$base" --build-arg NODE_BASE="$base" \
  -t gantry/setup-times:cold . > /dev/null
t1=$(now)
echo "product image, no layer cache (base image reused): $(took "$t0" "$t1") s"
docker rmi gantry/setup-times:cold > /dev/null
