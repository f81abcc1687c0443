# One image for the control plane (web, beat) and the GPU-host worker.
# The worker also needs the host's GPUs (see docker-compose.yml) and runs
# tritonserver from the nvidia-pytriton wheel as a local process.
# The bases are build arguments: where no registry is reachable, build from
# images made locally (e.g. --build-arg PYTHON_BASE=<a Debian image with Python 3.11 and pip>).
ARG NODE_BASE=node:20-bookworm-slim
ARG PYTHON_BASE=python:3.11-slim-bookworm

# The pages' chart library, from package-lock.json.
FROM ${NODE_BASE} AS frontend
WORKDIR /src
COPY package.json package-lock.json ./
RUN npm ci --omit=dev --no-audit --no-fund

FROM ${PYTHON_BASE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 GANTRY_DATA_DIR=/var/lib/gantry
WORKDIR /app
# Gantry's dependencies first, in a layer of their own that a change of code
# does not rebuild (wheels/: wheels to prefer over the index, e.g. a CPU torch).
COPY pyproject.toml requirements.lock ./
COPY wheels/ /wheels/
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['worker']))" > /tmp/requirements.txt \
 && pip install --no-cache-dir --find-links /wheels -c requirements.lock -r /tmp/requirements.txt
# The load generator, in an environment of its own (a GPU host's worker runs load tests).
COPY aiperf.lock ./
COPY scripts/ensure-aiperf.sh scripts/
RUN PYTHON=python scripts/ensure-aiperf.sh /opt/aiperf
ENV GANTRY_AIPERF=/opt/aiperf/bin/aiperf
# The wheel carries the pages' templates and static files (setup.py), as a user's does.
COPY setup.py MANIFEST.in ./
COPY templates templates
COPY static static
COPY --from=frontend /src/node_modules/uplot/dist/uPlot.iife.min.js /src/node_modules/uplot/dist/uPlot.min.css /src/node_modules/uplot/LICENSE static/vendor/
COPY docs/prometheus.yml docs/
COPY docs/grafana docs/grafana
COPY controlplane controlplane
COPY common common
COPY core core
COPY hosts hosts
COPY triton_server triton_server
COPY upstream upstream
COPY inference inference
COPY access access
COPY deployments deployments
COPY gateway gateway
COPY workers workers
COPY loadtests loadtests
RUN pip install --no-cache-dir --no-deps . && rm -rf build *.egg-info
COPY manage.py ./
RUN SECRET_KEY=collectstatic-only python manage.py collectstatic --noinput
EXPOSE 8000
CMD ["gantry", "web", "--bind", "0.0.0.0", "--port", "8000"]
