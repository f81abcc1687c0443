# Gantry: `make demo` runs the product on this machine; `make test` runs the whole suite.
# Both set up everything they need (virtual environment, Redis, PostgreSQL) and are idempotent.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

# Test files run on TEST_WORKERS processes at once (pytest-xdist; 0: one after
# another), each with its own PostgreSQL database and Redis database number
# (tests/parallel.py). A file stays on one process (pytest-xdist's loadfile).
TEST_WORKERS ?= 2

# Tests use their own PostgreSQL database and Redis database number.
TEST_ENV := DATABASE_URL=$${TEST_DATABASE_URL:-postgres://postgres:postgres@127.0.0.1:5432/gantry} \
            REDIS_URL=$${TEST_REDIS_URL:-redis://127.0.0.1:6379/15} \
            SECRET_KEY=gantry-test-secret-key-not-for-production \
            GANTRY_PLAIN_HTTP=1 \
            GANTRY_MODEL_ROOTS=/

.PHONY: venv frontend aiperf docs demo test gpu-test lint clean bench bench-gateway bench-api bench-live bench-pages bench-replicas bench-admission bench-channel bench-metrics bench-host-path bench-gpu bench-tuning bench-drain bench-outage bench-threads bench-download bench-grammars bench-structured

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -c requirements.lock -e ".[worker,dev]"
	touch $(STAMP)

venv: $(STAMP)

# The pages' chart library (npm, pinned by package-lock.json) in static/vendor/.
frontend:
	scripts/ensure-frontend.sh

# The load generator (AIPerf, pinned by aiperf.lock) in its own environment, .aiperf/.
aiperf:
	scripts/ensure-aiperf.sh

# The manual as a site (docs/ into var/site/; mkdocs-material in .docs/, pinned by
# docs.lock): any warning fails it, a broken link or anchor included.
docs:
	scripts/ensure-docs.sh
	NO_MKDOCS_2_WARNING=1 .docs/bin/mkdocs build --strict

demo: venv frontend aiperf
	scripts/ensure-packages.sh redis-server gcc
	$(VENV)/bin/gantry demo

# The GPU suite, on a GPU host (see docs/gpu-validation.md). It runs the
# control plane itself (manage.py gantry_demo --no-stack: SQLite, a Redis of
# its own from redis-server on PATH, a worker, the web and live servers) and
# talks to it through the REST API and the gateway. GPU_PYTHON: a python with
# Gantry's worker dependencies (the venv when there is one).
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-test:
	DATABASE_URL=sqlite:///$${TMPDIR:-/tmp}/gantry-gpu-test.sqlite3 SECRET_KEY=gantry-gpu-test-key GANTRY_MODEL_ROOTS=/ GANTRY_PLAIN_HTTP=1 \
	  $(GPU_PYTHON) -m pytest -m gpu tests/gpu -v $(PYTEST_ARGS)

# The seeds' stack through /v1 beside plain transformers in-process, on a GPU host.
BENCH_GPU_ARGS ?=
bench-gpu:
	SECRET_KEY=gantry-gpu-bench-key $(GPU_PYTHON) bench/gpu_stack.py $(BENCH_GPU_ARGS)

# llguidance (Gantry's) against xgrammar and outlines-core on the demo LLM's tokenizer (bench/grammars.py).
bench-grammars: venv
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --target .bench-grammars \
	  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 outlines-core==0.2.14
	PYTHONPATH=.bench-grammars $(PY) bench/grammars.py $(BENCH_GRAMMARS_ARGS)

# Streamed generation with a JSON schema against the same requests free, and llguidance on plain transformers.
bench-structured:
	SECRET_KEY=gantry-bench-structured $(GPU_PYTHON) bench/structured.py $(BENCH_STRUCTURED_ARGS)

# A host's hub download against the huggingface_hub CLI from the same local server (bench/download.py).
bench-download: venv
	SECRET_KEY=gantry-bench-download $(PY) bench/download.py $(BENCH_DOWNLOAD_ARGS)
	SECRET_KEY=gantry-bench-download $(PY) bench/download.py --first-ready $(BENCH_DOWNLOAD_ARGS)

# A tuning run of the seeds' stack against its hand-picked split, on a GPU host (bench/tuning.py).
BENCH_TUNING_ARGS ?=
bench-tuning:
	SECRET_KEY=gantry-gpu-bench-key $(GPU_PYTHON) bench/tuning.py $(BENCH_TUNING_ARGS)

# The gateway through a PostgreSQL outage, beside Triton directly (bench/outage.py).
bench-outage: venv
	scripts/ensure-services.sh
	$(PY) bench/outage.py $(BENCH_OUTAGE_ARGS)

# Replicas sharing one CPU host: Gantry's threads against every process on all cores (bench/threads.py).
bench-threads: venv
	SECRET_KEY=gantry-bench-threads $(PY) bench/threads.py $(BENCH_THREADS_ARGS)

# A scale-down under 32 live streams, drained against stopped at once, on a GPU host
# (bench/drain.py; GANTRY_GPU_SUITE_REHEARSAL=1 on a CPU host with the tiny LLM).
bench-drain:
	SECRET_KEY=gantry-gpu-bench-key $(GPU_PYTHON) bench/drain.py $(BENCH_DRAIN_ARGS)

# Benchmarks print each figure beside its floor, measured in the same run (see docs/performance.md).
BENCH_ARGS ?=
BENCH_GATEWAY_ARGS ?=
BENCH_API_ARGS ?=
BENCH_LIVE_ARGS ?=
BENCH_PAGES_ARGS ?=
BENCH_DECODE_ARGS ?=
BENCH_REPLICAS_ARGS ?=
BENCH_CHANNEL_ARGS ?=
bench: venv
	$(PY) bench/generate.py $(BENCH_ARGS)
	$(PY) bench/gateway.py $(BENCH_GATEWAY_ARGS)
	$(MAKE) bench-decode
	$(MAKE) bench-api
	$(MAKE) bench-live
	$(MAKE) bench-pages
	$(MAKE) bench-replicas
	$(MAKE) bench-admission
	$(MAKE) bench-channel
	$(MAKE) bench-metrics
	$(MAKE) bench-host-path
	$(MAKE) bench-outage
	$(MAKE) bench-threads
	$(MAKE) bench-download

# The REST API at fleet scale: PostgreSQL (BENCH_DATABASE_URL), Redis and wrk.
bench-api: venv
	scripts/ensure-services.sh
	scripts/ensure-packages.sh wrk
	$(PY) bench/api.py $(BENCH_API_ARGS)

# The live path: delivery to websocket clients, loss, reconnects (PostgreSQL; a Redis of its own).
bench-live: venv
	scripts/ensure-services.sh
	$(PY) bench/live.py $(BENCH_LIVE_ARGS)

# The pages at 100, 1 000 and 10 000 deployments and with 100 000 events, in headless Chromium (PostgreSQL, Redis).
bench-pages: venv frontend
	scripts/ensure-services.sh
	scripts/ensure-packages.sh chromium
	$(PY) bench/pages.py $(BENCH_PAGES_ARGS)

bench-gateway: venv
	$(PY) bench/gateway.py $(BENCH_GATEWAY_ARGS)

# The gateway's admission of a key with limits (one Lua step) against a plain Redis INCR.
bench-admission: venv
	scripts/ensure-services.sh
	$(PY) bench/admission.py

# The channel's mutual TLS against plain HTTP to the same Triton in a network namespace (root).
# Prometheus metrics on against off through the gateway, and a host's /metrics with 100 deployments.
bench-metrics: venv
	$(PY) bench/metrics.py $(BENCH_METRICS_ARGS)

# Node restriction's cost on a host's writes, and a host's database connections (PostgreSQL, Redis).
bench-host-path: venv
	$(PY) bench/host_path.py $(BENCH_HOST_PATH_ARGS)

bench-channel: venv
	$(PY) bench/channel.py $(BENCH_CHANNEL_ARGS)

# Replicas on three namespace hosts: added latency 3 vs 1, throughput 2 vs 1, a host's SIGKILL (root).
bench-replicas: venv
	scripts/ensure-services.sh
	$(PY) bench/replicas.py $(BENCH_REPLICAS_ARGS)

# The causal-LM decoder against the loop it replaced and plain generate (CPU; --gpu on a GPU host).
bench-decode:
	$(GPU_PYTHON) bench/decode.py $(BENCH_DECODE_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: venv lint frontend aiperf docs
	scripts/ensure-services.sh
	scripts/ensure-packages.sh chromium gcc docker-compose prometheus docker-registry nginx
	scripts/ensure-docker.sh
	scripts/build-triton-test-image.sh $(PY) > .triton-test-image
	tests/fixtures/build-builder-image.sh $(PY) $$(cat .triton-test-image) 0.16.0 > .builder-test-image
	scripts/build-product-image.sh > .product-test-image
	GANTRY_TEST_TRITON_IMAGE=$$(cat .triton-test-image) GANTRY_TEST_BUILDER_IMAGE=$$(cat .builder-test-image) \
	  GANTRY_TEST_PRODUCT_IMAGE=$$(cat .product-test-image) \
	  $(TEST_ENV) $(PY) -m pytest -p tests.parallel -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf var .pytest_cache .ruff_cache
