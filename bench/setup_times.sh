#!/usr/bin/env bash
# Cold set-up times (issue 29's report, not a benchmark with a target): each
# way of installing Gantry beside a plain `pip install django celery channels`
# timed in the same run, every pip without its cache. Prints seconds.
#   1. the floor: a fresh venv + pip install django celery channels
#   2. the wheel built from this checkout (make frontend first: it ships the chart library)
#   3. a fresh venv + pip install of that wheel with its worker extra (the lock as constraints)
#   4. from an empty folder with a new home, gantry demo until it prints its URL, and until
#      demo-stack is ready
#   5. the product image with no layer cache (scripts/build-product-image.sh's build)
# Usage: bench/setup_times.sh   (needs redis-server and docker; takes ~10 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'kill $(cat "$work/demo.pid" 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
now() { date +%s.%N; }
took() { python3 -c "print(f'{$2 - $1:.1f}')"; }

t0=$(now); python3 -m venv "$work/floor" && "$work/floor/bin/pip" install -q --no-cache-dir django celery channels; t1=$(now)
echo "floor: venv + pip install django celery channels: $(took "$t0" "$t1") s"

git archive --prefix=src/ HEAD | tar -x -C "$work"  # pip builds in the tree it builds from: not in the checkout
cp -r static/vendor "$work/src/static/"
t0=$(now); python3 -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$work/src"; t1=$(now)
echo "the wheel, built: $(took "$t0" "$t1") s"
wheel=$(ls "$work"/dist/gantry-*.whl)
t0=$(now); python3 -m venv "$work/gantry" && "$work/gantry/bin/pip" install -q --no-cache-dir -c requirements.lock "$wheel[worker]"; t1=$(now)
echo "venv + pip install of the wheel [worker]: $(took "$t0" "$t1") s"

port=$(python3 -c "import random; print(random.randrange(20000, 30000, 10))")
mkdir -p "$work/home" "$work/empty"
t0=$(now)
(cd "$work/empty" && HOME="$work/home" GANTRY_WEB_PORT="$port" GANTRY_AIPERF="$PWD/.aiperf/bin/aiperf" \
  setsid "$work/gantry/bin/gantry" demo > "$work/demo.log" 2>&1 & echo $! > "$work/demo.pid")
until grep -q "Gantry is running" "$work/demo.log"; do
  kill -0 "$(cat "$work/demo.pid")" 2>/dev/null || { tail -20 "$work/demo.log"; exit 1; }
  sleep 0.5
done
t1=$(now)
echo "gantry demo, first start until it prints its URL: $(took "$t0" "$t1") s"
database="$work/home/.local/share/gantry/gantry.sqlite3"
until python3 -c "import sqlite3, sys; sys.exit(0 if sqlite3.connect('$database').execute(\"select status from deployments_deployment where name='demo-stack'\").fetchone() == ('ready',) else 1)" 2>/dev/null; do
  sleep 0.5
done
t2=$(now)
echo "gantry demo, first start until demo-stack is ready: $(took "$t0" "$t2") s ($(took "$t1" "$t2") s after the URL)"
stop_demo() {  # Ctrl-C, and wait until it has stopped everything
  kill -INT -- -"$(cat "$work/demo.pid")" 2>/dev/null || true
  while kill -0 "$(cat "$work/demo.pid")" 2>/dev/null; do sleep 0.5; done
}
stop_demo
t0=$(now)
(cd "$work/empty" && HOME="$work/home" GANTRY_WEB_PORT="$port" setsid "$work/gantry/bin/gantry" demo > "$work/demo2.log" 2>&1 & echo $! > "$work/demo.pid")
until python3 -c "import sqlite3, sys; sys.exit(0 if sqlite3.connect('$database').execute(\"select status from deployments_deployment where name='demo-stack'\").fetchone() == ('ready',) else 1)" 2>/dev/null; do
  sleep 0.5
done
t1=$(now)
echo "gantry demo, warm second start until demo-stack is ready: $(took "$t0" "$t1") s"
stop_demo

base=$(scripts/build-python-base-image.sh)
t0=$(now)
DOCKER_BUILDKIT=0 docker build -q --no-cache --network host --build-arg PYTHON_BASE="$base" --build-arg NODE_BASE="$base" \
  -t gantry/setup-times:cold . > /dev/null
t1=$(now)
echo "product image, no layer cache (base image reused): $(took "$t0" "$t1") s"
docker rmi gantry/setup-times:cold > /dev/null
