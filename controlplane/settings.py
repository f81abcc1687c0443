"""Gantry settings: the one place that reads the environment (docs/configuration.md lists every variable).

Over 450 lines on purpose: every setting, its default, bounds and help, in one
module that docs/configuration.md is generated from."""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from common import paths
from common.private import private_file
from common.version import gantry_version
from controlplane.env import (
    env_bool,
    env_float,
    env_image_versions,
    env_int,
    env_list,
    env_port_range,
    env_str,
    env_ulimits,
    registry_credentials,
)
from core import queues

BASE_DIR = Path(__file__).resolve().parent.parent

DEBUG = env_bool("DEBUG", False, help="Django's debug mode: never in production")
_DEV_SECRET = "gantry-insecure-development-key-do-not-use-in-production"
SECRET_KEY = env_str(
    "SECRET_KEY",
    _DEV_SECRET if DEBUG else None,
    help="Django's signing key (sessions, CSRF); or SECRET_KEY_FILE, a file holding it",
    shown="required unless `DEBUG` (`gantry demo` writes `secret_key` in `GANTRY_DATA_DIR`)",
)
if not DEBUG and SECRET_KEY == _DEV_SECRET:
    raise ImproperlyConfigured("SECRET_KEY: the development key is refused when DEBUG is off")
ALLOWED_HOSTS = env_list(
    "ALLOWED_HOSTS",
    ["localhost", "127.0.0.1", "[::1]"],
    help="host names the web server answers to (also the websocket origin check)",
)
CSRF_TRUSTED_ORIGINS = env_list(
    "CSRF_TRUSTED_ORIGINS", [], help="origins allowed to POST forms, e.g. `https://gantry.example.org` behind a proxy"
)

# --- Transport security ---------------------------------------------------
# Secure by default: HTTPS only (redirect, HSTS, secure cookies), so that with
# DEBUG off and nothing else set `manage.py check --deploy` finds nothing. A
# plain-HTTP setup (the demo, the tests, a laptop) opts out explicitly with
# GANTRY_PLAIN_HTTP=1. Behind a TLS-terminating proxy, GANTRY_TRUST_PROXY_TLS=1
# trusts its X-Forwarded-Proto header.
GANTRY_PLAIN_HTTP = env_bool(
    "GANTRY_PLAIN_HTTP",
    False,
    help=(
        "serve plain HTTP: no redirect to HTTPS, no HSTS, cookies without `Secure`. Off by default, so "
        "that with `DEBUG` off and nothing else set `manage.py check --deploy` reports nothing"
    ),
    shown="`0` (`make demo` and `make test` set `1`)",
)
_https = not GANTRY_PLAIN_HTTP
SECURE_SSL_REDIRECT = _https
SESSION_COOKIE_SECURE = _https
CSRF_COOKIE_SECURE = _https
SECURE_HSTS_SECONDS = env_int(
    "GANTRY_HSTS_SECONDS",
    31_536_000 if _https else 0,
    minimum=0,
    help="the `Strict-Transport-Security` max-age over HTTPS",
    shown="`31536000` (`0` with `GANTRY_PLAIN_HTTP`)",
)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("GANTRY_HSTS_INCLUDE_SUBDOMAINS", True, help="HSTS's `includeSubDomains`")
SECURE_HSTS_PRELOAD = env_bool("GANTRY_HSTS_PRELOAD", True, help="HSTS's `preload`")
if env_bool(
    "GANTRY_TRUST_PROXY_TLS", False, help="behind a TLS-terminating proxy: trust its `X-Forwarded-Proto: https`"
):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
# Health and metrics checks from the host itself need no redirect.
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]
SESSION_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"

# --- Abuse limits ---------------------------------------------------------
# REST API requests per signed-in user and per anonymous address ("<n>/<second|minute|hour|day>", or "off").
GANTRY_API_THROTTLE = env_str(
    "GANTRY_API_THROTTLE",
    "1200/minute",
    help=(
        "REST API requests per API token, or per user for a browser session (`<n>/second|minute|hour|day`, or"
        " `off`), in one fixed window shared by the API and the generate action; over it, 429 with"
        " `Retry-After`. Counted in Redis across processes; not limited while Redis is down"
    ),
)
GANTRY_API_THROTTLE_ANON = env_str(
    "GANTRY_API_THROTTLE_ANON", "120/minute", help="REST API requests per anonymous address, as `GANTRY_API_THROTTLE`"
)
# Failed sign-ins per account, and per address, before the form refuses for GANTRY_LOGIN_LOCKOUT_S.
GANTRY_LOGIN_ATTEMPTS = env_int(
    "GANTRY_LOGIN_ATTEMPTS",
    5,
    minimum=1,
    help="failed sign-ins for one user name (from any address) before the sign-in form (also the admin's) refuses it",
)
GANTRY_LOGIN_ADDRESS_ATTEMPTS = env_int(
    "GANTRY_LOGIN_ADDRESS_ATTEMPTS",
    30,
    minimum=1,
    help="failed sign-ins from one address (for any user names) before the sign-in form refuses that address",
)
GANTRY_LOGIN_LOCKOUT_S = env_int(
    "GANTRY_LOGIN_LOCKOUT_S",
    900,
    minimum=1,
    help="seconds a count of failed sign-ins runs, and the form refuses once it reaches its limit",
)

# Single sign-on (OpenID Connect, access/oidc.py): off while GANTRY_OIDC_ISSUER is empty.
GANTRY_OIDC_ISSUER = env_str(
    "GANTRY_OIDC_ISSUER",
    "",
    help="the OpenID provider's issuer URL (its /.well-known/openid-configuration is read); empty: no single sign-on",
)
GANTRY_OIDC_CLIENT_ID = env_str("GANTRY_OIDC_CLIENT_ID", "", help="Gantry's client id at the OpenID provider")
GANTRY_OIDC_CLIENT_SECRET = env_str(
    "GANTRY_OIDC_CLIENT_SECRET",
    "",
    help="Gantry's client secret at the OpenID provider (or GANTRY_OIDC_CLIENT_SECRET_FILE)",
)
GANTRY_OIDC_NAME = env_str(
    "GANTRY_OIDC_NAME", "single sign-on", help="the provider's name on the sign-in page's button"
)
GANTRY_OIDC_GROUPS_CLAIM = env_str(
    "GANTRY_OIDC_GROUPS_CLAIM", "groups", help="the ID token or userinfo claim that lists a user's groups"
)
GANTRY_OIDC_ADMIN_GROUPS = env_list(
    "GANTRY_OIDC_ADMIN_GROUPS", [], help="provider groups whose members get Gantry's admin role"
)
GANTRY_OIDC_OPERATOR_GROUPS = env_list(
    "GANTRY_OIDC_OPERATOR_GROUPS", [], help="provider groups whose members get the operator role"
)
GANTRY_OIDC_RECHECK_MINUTES = env_int(
    "GANTRY_OIDC_RECHECK_MINUTES",
    10,
    minimum=1,
    maximum=1440,
    help="how often the provider is asked again whether each signed-in person still holds their roles "
    "(removed or demoted there: their access ends within this many minutes, and one more for the check's beat)",
)
GANTRY_OIDC_SCOPES = env_str(
    "GANTRY_OIDC_SCOPES",
    "openid email profile",
    help="the scopes asked of the provider: add the one that releases the groups claim where your provider "
    "needs it (`groups` for many; `offline_access` where refresh tokens need it)",
)
GANTRY_OIDC_VIEWER_GROUPS = env_list(
    "GANTRY_OIDC_VIEWER_GROUPS",
    [],
    help="provider groups whose members may sign in as viewers (`*`: every user the provider signs in); "
    "a user in none of the three groups is refused",
)

GANTRY_DATA_DIR = Path(
    env_str(
        "GANTRY_DATA_DIR",
        str(paths.default_data_dir()),
        help="model repositories, Triton logs, the demo's database and secret key",
        shown="`var` in a checkout; installed: `$XDG_DATA_HOME/gantry` (`~/.local/share/gantry`)",
    )
).resolve()
# PostgreSQL connections come from a pool per process (psycopg_pool): a
# request borrows one and gives it back, so web and live processes reuse
# connections without each thread holding its own (DATABASE_CONN_MAX_AGE>0
# under ASGI opened one per thread until PostgreSQL refused more clients).
# The ASGI servers turn it on (controlplane.asgi); elsewhere it stays off: a
# Celery worker forks after start-up, and a pool's threads do not survive a fork.
DATABASE_POOL_TIMEOUT = env_int(
    "DATABASE_POOL_TIMEOUT", 10, minimum=1, help="seconds a request waits for a pooled connection"
)
DATABASE_POOL_SIZE = env_int(
    "DATABASE_POOL_SIZE",
    0,
    minimum=0,
    maximum=200,
    help=(
        "PostgreSQL connections each server process borrows from its own pool (also the threads a web "
        "process runs pages and API calls on); `0`: no pool"
    ),
    shown="`4` in the web and live servers, `0` elsewhere (the pages server never pools)",
)
DATABASES = {
    "default": dj_database_url.parse(
        env_str(
            "DATABASE_URL",
            f"sqlite:///{GANTRY_DATA_DIR / 'gantry.sqlite3'}",
            help="the database: PostgreSQL (`postgres://user:pass@host:5432/db`) for anything but the demo",
            shown="`sqlite:///` in `GANTRY_DATA_DIR`",
        ),
        conn_max_age=env_int(
            "DATABASE_CONN_MAX_AGE",
            0,
            minimum=0,
            help="seconds to keep database connections open (must stay 0 with a pool)",
            shown="`60` in the pages server, `0` elsewhere",
        ),
        # A kept connection is checked before a request reuses it: after a
        # PostgreSQL restart the next request opens a new one instead of failing.
        # (Not with a pool: Django then has the pool check each connection it
        # lends, and with the database away a request waited the pool's timeout.)
        conn_health_checks=not DATABASE_POOL_SIZE,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    if str(DATABASES["default"]["NAME"]) not in ("", ":memory:"):
        private_file(Path(DATABASES["default"]["NAME"]))  # it holds password hashes and Triton's secrets
    # The demo's worker and web server write concurrently: wait for the lock.
    DATABASES["default"].setdefault("OPTIONS", {})["timeout"] = 20
    # Take the write lock when a transaction begins: a deferred one that tries to
    # write after another process wrote fails at once with "database is locked",
    # whatever the timeout (seen from the demo's outbox sender).
    DATABASES["default"]["OPTIONS"]["transaction_mode"] = "IMMEDIATE"
    # Readers never wait for a writer's commit (the gateway's reads beside the
    # worker's and the usage flush's writes).
    DATABASES["default"]["OPTIONS"]["init_command"] = "PRAGMA journal_mode=WAL"
elif DATABASE_POOL_SIZE:
    if DATABASES["default"]["CONN_MAX_AGE"]:
        raise ImproperlyConfigured("DATABASE_CONN_MAX_AGE: must be 0 with a pool (DATABASE_POOL_SIZE=0 turns it off)")
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1,
        "max_size": DATABASE_POOL_SIZE,
        "timeout": DATABASE_POOL_TIMEOUT,
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env_str(
    "REDIS_URL", "redis://127.0.0.1:6379/0", help="Redis: the Celery broker, the channel layer, throttle counters"
)
# Where the browser reaches the live (websocket) server: empty for the pages'
# own address (a proxy routes /ws/ there), or a port on the same host.
GANTRY_LIVE_PORT = env_str(
    "GANTRY_LIVE_PORT",
    "",
    help=(
        "where the browser reaches the live server: empty when `/ws/` of the pages' own address reaches it "
        "(a proxy routes it there, or the demo's one port serves it), or a port of the same host"
    ),
    shown="empty",
)
if GANTRY_LIVE_PORT and not (GANTRY_LIVE_PORT.isdigit() and 1 <= int(GANTRY_LIVE_PORT) <= 65535):
    raise ImproperlyConfigured("GANTRY_LIVE_PORT: must be a port number (1-65535) or empty")

# --- Gantry's own ---------------------------------------------------------
# The name this process's host is known by; a worker listens on gpu.<name>.
GANTRY_HOST_NAME = env_str(
    "GANTRY_HOST_NAME",
    socket.gethostname().split(".")[0],
    help=(
        "the host a worker serves; it listens on queues `gpu.<name>` (control) and `gpu.<name>.jobs` "
        "(builds, load tests)"
    ),
    shown="this machine's short host name",
)
# This process runs with a joined host's own credentials (`gantry join` sets it):
# its live messages go to its Redis stream, which the control plane checks and
# relays (deployments.live_relay), and its outbox sends to its own queues only.
GANTRY_JOINED_HOST = env_bool(
    "GANTRY_JOINED_HOST",
    False,
    help=(
        "set by `gantry join`: the worker runs with the host's own credentials, so its live messages go through "
        "the control plane's relay (run by `gantry beat`) and the beat sends its tasks for other hosts"
    ),
)
# Model code (tritonserver and its python stubs) runs as this user, not as the
# worker: it cannot read the worker's environment, its settings file, the
# channel's key or the Docker socket (workers.model_user). `gantry join` makes it.
GANTRY_MODEL_USER = env_str(
    "GANTRY_MODEL_USER",
    "",
    help=(
        "the unprivileged user tritonserver and the model code in it run as on this host (`gantry join` makes "
        "`gantry-model`); the worker must be root or hold CAP_SETUID, CAP_SETGID, CAP_CHOWN and CAP_KILL, as the "
        "unit `gantry join` writes gives it. Empty: model code runs as the worker, with its secrets"
    ),
)
# The address Triton servers on this host bind to and clients use to reach them.
GANTRY_HOST_ADDRESS = env_str(
    "GANTRY_HOST_ADDRESS",
    "127.0.0.1",
    help="where the web tier reaches this host: its channel listens there (Triton servers bind loopback)",
)
GANTRY_CHANNEL_PORT = env_int(
    "GANTRY_CHANNEL_PORT",
    17443,
    minimum=1,
    maximum=65535,
    help="the port of a GPU host's channel (mutual TLS to its Triton servers) on GANTRY_HOST_ADDRESS",
)
GANTRY_METRICS_TOKEN = env_str(
    "GANTRY_METRICS_TOKEN",
    "",
    help="the bearer token Prometheus sends to read /metrics on web, live and each host's worker "
    "(or GANTRY_METRICS_TOKEN_FILE); empty: no metrics are kept and /metrics answers 404",
)
GANTRY_WORKER_METRICS_PORT = env_int(
    "GANTRY_WORKER_METRICS_PORT",
    17444,
    minimum=0,
    maximum=65535,
    help="the port of a host worker's /metrics on GANTRY_HOST_ADDRESS (its own figures, and its Triton "
    "servers' and GPUs' relabelled by deployment, replica and model); 0: none",
)
GANTRY_CHANNEL_CERT_HOURS = env_int(
    "GANTRY_CHANNEL_CERT_HOURS",
    720,
    minimum=1,
    maximum=24 * 398,
    help="lifetime of the channel certificates Gantry's authority signs; renewed when two thirds are gone",
)
GANTRY_HEARTBEAT_INTERVAL = env_int(
    "GANTRY_HEARTBEAT_INTERVAL",
    10,
    minimum=1,
    maximum=3600,
    help="seconds between host-agent beats (and reconcile passes)",
)
GANTRY_HOST_OFFLINE_AFTER_BEATS = env_int(
    "GANTRY_HOST_OFFLINE_AFTER_BEATS", 3, minimum=1, help="missed beats after which a host is shown offline"
)
GANTRY_TRITON_READY_TIMEOUT = env_int(
    "GANTRY_TRITON_READY_TIMEOUT",
    900,
    minimum=5,
    help="seconds a launch waits for the server and every model to be ready (and a model load or unload may take)",
)
# The host worker's wait on any call to its Triton servers but a model load or
# unload, which may take as long as GANTRY_TRITON_READY_TIMEOUT.
GANTRY_TRITON_REQUEST_TIMEOUT = env_int(
    "GANTRY_TRITON_REQUEST_TIMEOUT",
    60,
    minimum=1,
    maximum=3600,
    help="seconds the host's worker waits on any other call to its Triton servers",
)
GANTRY_TRITON_PORT_RANGE = env_port_range(
    "GANTRY_TRITON_PORT_RANGE",
    (18000, 18999),
    help="ports handed to deployments, three each (HTTP, gRPC, metrics) per host",
)
# Triton images the docker runtime may start (exact references, e.g. repo/name:tag).
GANTRY_ALLOWED_IMAGES = env_list(
    "GANTRY_ALLOWED_IMAGES",
    [],
    help="Triton images the docker runtime may start (exact references); nothing else is ever run",
)
GANTRY_REGISTRY_CREDENTIALS = registry_credentials(
    env_str(
        "GANTRY_REGISTRY_CREDENTIALS",
        "",
        help="a GPU host's logins to the registries its allow-listed images come from, JSON: "
        '`{"<registry host[:port]>": {"username": "...", "password": "..."}}` (`default` for an image that names no '
        "registry; or GANTRY_REGISTRY_CREDENTIALS_FILE); never logged nor shown",
    )
)
# ulimits of Triton containers: NVIDIA's recommendation by default (unlimited
# locked memory, 64 MiB stack). A host that forbids raising memlock drops it here.
GANTRY_DOCKER_ULIMITS = env_ulimits(
    "GANTRY_DOCKER_ULIMITS",
    [("memlock", -1, -1), ("stack", 67108864, 67108864)],
    help=(
        "ulimits of Triton containers; NVIDIA's recommendation by default (a host that forbids raising "
        "memlock drops it here)"
    ),
)
GANTRY_METRICS_RETENTION_HOURS = env_int(
    "GANTRY_METRICS_RETENTION_HOURS", 24, minimum=1, help="how long metric samples are kept"
)
GANTRY_GPU_RELEASE_TIMEOUT = env_int(
    "GANTRY_GPU_RELEASE_TIMEOUT",
    60,
    minimum=1,
    help=(
        "seconds a stop waits for NVML to show the server's processes released their GPU memory; a "
        "deployment still holding memory then is marked failed, not stopped"
    ),
)
GANTRY_HOST_LOST_GRACE_S = env_int(
    "GANTRY_HOST_LOST_GRACE_S",
    60,
    minimum=1,
    help="seconds without a beat after which a host's replicas are marked lost and replaced on hosts with room",
)
GANTRY_EJECT_AFTER_FAILURES = env_int(
    "GANTRY_EJECT_AFTER_FAILURES",
    3,
    minimum=1,
    help="failed requests in a row after which a gateway process stops routing to a replica for a cool-off",
)
GANTRY_EJECT_COOLOFF_S = env_int(
    "GANTRY_EJECT_COOLOFF_S", 30, minimum=1, help="seconds an ejected replica gets no requests before it is tried again"
)
GANTRY_CRASH_RESTART_LIMIT = env_int(
    "GANTRY_CRASH_RESTART_LIMIT", 3, minimum=0, help="automatic restarts of a crashed server within 10 minutes"
)
GANTRY_GPU_MEMORY_HEADROOM = env_float(
    "GANTRY_GPU_MEMORY_HEADROOM",
    0.95,
    minimum=0.1,
    maximum=1.0,
    help=(
        "the most the GPU memory shares (fraction x instances) of all deployments' models on one GPU may "
        "add up to; a start or change past it is refused, naming the deployments already there"
    ),
)
# The CUDA context each server process on a GPU holds beyond its memory share
# (measured on an H100: 584 MiB for tritonserver, about 700 for a python stub).
GANTRY_GPU_PROCESS_RESERVE_MIB = env_int(
    "GANTRY_GPU_PROCESS_RESERVE_MIB",
    768,
    minimum=0,
    maximum=65536,
    help=(
        "what the GPU plan counts for each server process's CUDA context beside the fractions (measured "
        "on an H100: 584 MiB for tritonserver, about 700 for a python stub)"
    ),
)
# Checkpoints may only be registered from under these folders (a worker
# mounts or reads nothing else). Empty means the data dir's models/ only.
GANTRY_MODEL_ROOTS = [
    Path(p).resolve()
    for p in env_list(
        "GANTRY_MODEL_ROOTS",
        [str(GANTRY_DATA_DIR / "models")],
        help=(
            "folders checkpoints may be registered from; a worker reads nothing else (the demo adds the "
            "MiniLM package folder)"
        ),
        shown="`$GANTRY_DATA_DIR/models`",
    )
]
# Models downloaded from a hub (huggingface_hub's snapshot download) land in
# each host's own cache, in the hub's layout (blobs named by their hash,
# snapshots by commit). The cache is a model root of its own.
GANTRY_HUB_CACHE = Path(
    env_str(
        "GANTRY_HUB_CACHE",
        str(GANTRY_DATA_DIR / "hub"),
        help="a GPU host's cache of models downloaded from the hub (always readable as a model root)",
        shown="`$GANTRY_DATA_DIR/hub`",
    )
).resolve()
if not any(GANTRY_HUB_CACHE == root or root in GANTRY_HUB_CACHE.parents for root in GANTRY_MODEL_ROOTS):
    GANTRY_MODEL_ROOTS.append(GANTRY_HUB_CACHE)
GANTRY_HUB_ENDPOINT = env_str(
    "GANTRY_HUB_ENDPOINT",
    "",
    help="the hub (or a mirror of it) a GPU host downloads models from, as `HF_ENDPOINT` says it; empty: "
    "huggingface_hub's default",
)
GANTRY_HUB_TOKEN = env_str(
    "GANTRY_HUB_TOKEN",
    "",
    help="a GPU host's access token for gated and private models (or GANTRY_HUB_TOKEN_FILE); never logged, "
    "shown or passed to model code",
)
GANTRY_HUB_CACHE_QUOTA_GB = env_float(
    "GANTRY_HUB_CACHE_QUOTA_GB",
    0.0,
    minimum=0.0,
    help="the most a GPU host's hub cache holds, in GiB: a download evicts the least recently used models "
    "(never one in use or pinned) to fit; 0: no quota, only the free disk",
)
GANTRY_HUB_VIA_CONTROL_PLANE = env_bool(
    "GANTRY_HUB_VIA_CONTROL_PLANE",
    False,
    help="a GPU host that reaches neither the hub nor a mirror downloads models through the control plane "
    "(`GANTRY_GATEWAY_URL`), which relays them over the channel from a host that holds them",
)
GANTRY_HUB_FILES_PORT = env_int(
    "GANTRY_HUB_FILES_PORT",
    17445,
    minimum=0,
    maximum=65535,
    help="the loopback port a GPU host serves its hub cache on, read-only, to its channel (the control plane's "
    "relay for other hosts); 0: none",
)
GANTRY_HUB_DOWNLOAD_WORKERS = env_int(
    "GANTRY_HUB_DOWNLOAD_WORKERS", 8, minimum=1, maximum=64, help="files a host downloads at once"
)
# Engine builds. Builder images are allow-listed with the TensorRT-LLM version
# they carry (image=version): that version picks the command-line table.
GANTRY_BUILDER_IMAGES = env_image_versions(
    "GANTRY_BUILDER_IMAGES",
    {},
    help=(
        "the builder images builds may use, each with the TensorRT-LLM version it carries (an engine is "
        "served from the image it was built in, so list serving images here too)"
    ),
)
GANTRY_BUILD_TIME_LIMIT = env_int(
    "GANTRY_BUILD_TIME_LIMIT",
    7200,
    minimum=60,
    help="a build's default time limit in seconds (a request may ask up to `GANTRY_BUILD_TIME_LIMIT_MAX`)",
)
GANTRY_BUILD_TIME_LIMIT_MAX = env_int(
    "GANTRY_BUILD_TIME_LIMIT_MAX",
    86400,
    minimum=GANTRY_BUILD_TIME_LIMIT,
    help="the longest time limit a build request may ask for, in seconds",
)
GANTRY_BUILD_LOG_LINES = env_int("GANTRY_BUILD_LOG_LINES", 5000, minimum=100, help="build output lines kept per build")
# A running build whose worker has not reported for this long is failed by the sweeper.
GANTRY_BUILD_STALE_AFTER = env_int(
    "GANTRY_BUILD_STALE_AFTER",
    120,
    minimum=30,
    help="seconds without a heartbeat after which the sweeper fails a running build",
)
# Native builds: the python that has tensorrt_llm installed, and its examples folder.
GANTRY_TRTLLM_PYTHON = env_str(
    "GANTRY_TRTLLM_PYTHON",
    "",
    help=(
        "native builds and load tests' native ceiling: the python with tensorrt_llm installed (its "
        "`trtllm-bench` beside it)"
    ),
)
# Load tests: AIPerf in its own environment on each GPU host (scripts/ensure-aiperf.sh),
# and the address that host's worker reaches the gateway at.
GANTRY_AIPERF = env_str(
    "GANTRY_AIPERF",
    str((BASE_DIR / ".aiperf" if paths.SOURCE_CHECKOUT else GANTRY_DATA_DIR / "aiperf") / "bin" / "aiperf"),
    help="the load generator a host's worker runs (`gantry check --install` installs it)",
    shown="`.aiperf/bin/aiperf` in a checkout; installed: `aiperf/bin/aiperf` in `GANTRY_DATA_DIR`",
)
GANTRY_GATEWAY_URL = env_str(
    "GANTRY_GATEWAY_URL",
    "http://127.0.0.1:8000",
    help="where a host's worker reaches the gateway for load tests",
    shown="`http://127.0.0.1:8000` (`make demo`: its own web port)",
).rstrip("/")
GANTRY_GATEWAY_LIMITS_WITHOUT_REDIS = env_str(
    "GANTRY_GATEWAY_LIMITS_WITHOUT_REDIS",
    "open",
    help="while Redis is unreachable, keys with rate limits are served without them (`open`) or refused with 503"
    " (`closed`)",
)
if GANTRY_GATEWAY_LIMITS_WITHOUT_REDIS not in ("open", "closed"):
    raise ImproperlyConfigured("GANTRY_GATEWAY_LIMITS_WITHOUT_REDIS: must be open or closed")
GANTRY_TRTLLM_EXAMPLES_DIR = env_str(
    "GANTRY_TRTLLM_EXAMPLES_DIR", "", help="native builds: TensorRT-LLM's `examples` folder"
)
# Where joining GPU hosts reach PostgreSQL and Redis (`gantry join`), when that
# differs from this process's DATABASE_URL / REDIS_URL (a private address, say);
# the user and password in them are replaced by each host's own.
GANTRY_JOIN_DATABASE_URL = env_str(
    "GANTRY_JOIN_DATABASE_URL",
    "",
    help=(
        "where joining GPU hosts reach PostgreSQL (`gantry join`), when it differs from the web side's; "
        "the user and password are replaced by each host's own"
    ),
    shown="`DATABASE_URL`'s address",
)
GANTRY_JOIN_REDIS_URL = env_str(
    "GANTRY_JOIN_REDIS_URL",
    "",
    help="where joining GPU hosts reach Redis, as `GANTRY_JOIN_DATABASE_URL`",
    shown="`REDIS_URL`'s address",
)

INSTALLED_APPS = [
    "daphne",
    "access.apps.GantryAdminConfig",  # the admin, for the admin role only
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "controlplane",
    "core",
    "access",
    "hosts",
    "deployments",
    "gateway",
    "loadtests",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "controlplane.middleware.StaticFiles",  # WhiteNoise, able to stay async
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [paths.shipped("templates")],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "access.context.role",
                "controlplane.context.live",
            ]
        },
    }
]

AUTHENTICATION_BACKENDS = [
    "django.contrib.auth.backends.ModelBackend",
    "access.admin_site.AdminGroupBackend",
    "access.oidc.Backend",  # single sign-on; answers nothing while GANTRY_OIDC_ISSUER is empty
]
if GANTRY_OIDC_ISSUER:
    _issuer = urlsplit(GANTRY_OIDC_ISSUER)
    if _issuer.scheme not in ("https", "http") or not _issuer.hostname:
        raise ImproperlyConfigured(f"GANTRY_OIDC_ISSUER: {GANTRY_OIDC_ISSUER!r} is not an http(s) URL")
    if _issuer.scheme == "http" and not (GANTRY_PLAIN_HTTP or _issuer.hostname in ("localhost", "127.0.0.1", "::1")):
        raise ImproperlyConfigured(
            "GANTRY_OIDC_ISSUER must be https:// (tokens cross it), unless GANTRY_PLAIN_HTTP is set"
        )
    if not (GANTRY_OIDC_CLIENT_ID and GANTRY_OIDC_CLIENT_SECRET):
        raise ImproperlyConfigured(
            "GANTRY_OIDC_ISSUER is set: GANTRY_OIDC_CLIENT_ID and GANTRY_OIDC_CLIENT_SECRET are required"
        )
# mozilla-django-oidc's own settings, from Gantry's (access/oidc.py reads the provider's endpoints by discovery).
OIDC_RP_CLIENT_ID = GANTRY_OIDC_CLIENT_ID
OIDC_RP_CLIENT_SECRET = GANTRY_OIDC_CLIENT_SECRET
OIDC_RP_SIGN_ALGO = "RS256"
OIDC_RP_SCOPES = GANTRY_OIDC_SCOPES
OIDC_USE_PKCE = True
OIDC_AUTHENTICATE_CLASS = "access.oidc.Authenticate"
OIDC_CALLBACK_CLASS = "access.oidc.Callback"
LOGIN_REDIRECT_URL_FAILURE = "/login/?sso=failed"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
FORMAT_MODULE_PATH = ["controlplane.formats"]  # every page writes times one way (controlplane/formats/en)
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [paths.shipped("static")]
STATIC_ROOT = GANTRY_DATA_DIR / "static"
WHITENOISE_USE_FINDERS = True

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # First, so that a request without credentials is a 401 that names the scheme.
        "access.auth.PersonalTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "EXCEPTION_HANDLER": "core.api.base.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "core.api.schema.GantrySchema",
    # Bodies are JSON objects: nested specs and lists have no honest form encoding.
    "DEFAULT_PARSER_CLASSES": ["controlplane.parsers.JSONParser"],
    "DEFAULT_RENDERER_CLASSES": [
        "core.api.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    "DEFAULT_THROTTLE_CLASSES": ["access.throttles.PerUser", "access.throttles.PerAddress"],
}

# Throttle counters and sign-in failures live in Redis, so every web process
# counts together; they fail open (an outage must not lock everyone out).
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "shared": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "gantry",
        "OPTIONS": {"socket_connect_timeout": 0.5, "socket_timeout": 0.5},
    },
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Gantry API",
    "DESCRIPTION": "Register checkpoints, build TensorRT-LLM engines, and deploy and operate "
    "multi-model Triton servers on GPU hosts. The OpenAI-compatible gateway (/v1) is documented "
    "by OpenAI's own reference; this schema covers /api/.",
    "VERSION": gantry_version(),
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["core.permissions.CanView"],
    "SCHEMA_PATH_PREFIX": "/api/",
    "COMPONENT_SPLIT_REQUEST": True,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "core.api.schema.refuse_unknown_fields",
    ],
    "ENUM_NAME_OVERRIDES": {
        "BuildStatusEnum": "deployments.models.BuildStatus",
        "DeploymentStatusEnum": "deployments.models.DeploymentStatus",
        "RevisionStatusEnum": "deployments.models.RevisionStatus",
        "ModelKindEnum": "deployments.models.ModelKind",
        "PlacementDtypeEnum": "deployments.models.Dtype",
        "MetricKindEnum": "deployments.models.MetricSample.Kind",
        "PluginEnum": "upstream.trtllm.PLUGIN_CHOICES",
        "RunStatusEnum": "loadtests.models.RunStatus",
        "TrialStatusEnum": "loadtests.models.TrialStatus",
    },
}

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        # capacity: messages a socket may fall behind by before the layer drops
        # them (silently; the browser sees the gap in the numbers and re-reads).
        "CONFIG": {"hosts": [REDIS_URL], "prefix": "gantry:channels", "capacity": 1000},
    }
}

CELERY_BROKER_URL = REDIS_URL
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_IGNORE_RESULT = True
# GPU work is long and not evenly sized: take one message at a time, and
# acknowledge late so a message whose worker died is delivered again; tasks
# re-check the database row, so a redelivery never repeats finished work.
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": env_int(
        "CELERY_VISIBILITY_TIMEOUT", 3600, minimum=60, help="seconds before Redis redelivers a task whose worker died"
    ),
    # A host's unacknowledged messages under its own keys, which its Redis user may touch.
    **queues.unacked_options(GANTRY_HOST_NAME),
}
# No remote control (its fanout keys are shared): Gantry drives workers through
# the database and their queues.
CELERY_WORKER_ENABLE_REMOTE_CONTROL = False
CELERY_TASK_SOFT_TIME_LIMIT = GANTRY_TRITON_READY_TIMEOUT + 120
CELERY_TASK_TIME_LIMIT = GANTRY_TRITON_READY_TIMEOUT + 180

CELERY_BEAT_SCHEDULE = {
    "sweep-hosts": {
        "task": queues.SWEEP_HOSTS,
        "schedule": float(GANTRY_HEARTBEAT_INTERVAL),
        "options": {"queue": "control", "expires": float(GANTRY_HEARTBEAT_INTERVAL)},
    },
    # Joined hosts' database grants and Redis users, given again after a migration or a Redis restart.
    "sync-host-access": {
        "task": queues.SYNC_HOST_ACCESS,
        "schedule": 30.0,
        "options": {"queue": "control", "expires": 30.0},
    },
    # Single sign-on: each signed-in person asked about again (access.oidc.identities_recheck).
    "recheck-sso-identities": {
        "task": "access.tasks.recheck_identities",
        "schedule": 60.0,
        "options": {"queue": "control", "expires": 60.0},
    },
    # A load test's or tuning run's gateway key ends with its run (its host may not revoke keys).
    "revoke-ended-run-keys": {
        "task": "loadtests.tasks.revoke_ended_run_keys",
        "schedule": float(GANTRY_HEARTBEAT_INTERVAL),
        "options": {"queue": "control", "expires": float(GANTRY_HEARTBEAT_INTERVAL)},
    },
    "reap-load-tests": {
        "task": "loadtests.tasks.reap_runs",
        "schedule": 30.0,
        "options": {"queue": "control", "expires": 30.0},
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO", help="log level of every process").upper()},
    "loggers": {"daphne": {"level": "WARNING"}, "django.channels.server": {"level": "WARNING"}},
}
