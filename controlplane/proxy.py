"""One address in front of Gantry's three servers: nginx's configuration for it
(``gantry proxy-config``). Which path goes where is said once, in ROUTES:

- the websockets (/ws/) to live;
- the doors that stream or wait on Triton (the OpenAI gateway under /v1/, the
  generate action, /metrics) to web, unbuffered, so each token leaves as it comes;
- everything else (pages, the REST API, the admin, static files) to pages.

Upstream connections are kept alive (HTTP/1.1, an empty Connection header),
as the sync floor's clients keep theirs. TLS is the operator's: add ``listen
443 ssl`` and the certificate to the server block, and set
GANTRY_TRUST_PROXY_TLS=1 so Django takes nginx's X-Forwarded-Proto.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Route:
    location: str  # an nginx location: a prefix, "= path" or "~ regex"
    server: str  # pages, web or live
    why: str
    streams: bool = False  # answers as it goes: no buffering, long reads
    websocket: bool = False


ROUTES = (
    Route("/ws/", "live", "the browser's live updates (Channels)", websocket=True),
    Route("/v1/", "web", "the OpenAI-compatible gateway", streams=True),
    Route("~ ^/api/deployments/[0-9]+/generate/$", "web", "the generate action (streamed)", streams=True),
    Route("= /metrics", "web", "Prometheus' scrape (the web tier's figures and the fleet's)"),
    Route("/", "pages", "pages, the REST API, the admin, static files"),
)
SERVERS = ("pages", "web", "live")
# Where each server listens unless told (gantry web|pages|live, and the proxy's defaults).
DEFAULT_PORTS = {"web": 8000, "live": 8001, "pages": 8002}
PORTS_HELP = ", ".join(f"{port} ({name})" for name, port in DEFAULT_PORTS.items())
# How long a streamed answer or a websocket may stay silent before nginx gives up on it.
STREAM_READ_TIMEOUT_S = 3600
KEEPALIVE_CONNECTIONS = 64


def _headers(route: Route) -> list[str]:
    # nginx drops every inherited proxy_set_header where a location sets one: all of them, here.
    headers = [
        "proxy_set_header Host $http_host;",
        "proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;",
        "proxy_set_header X-Forwarded-Proto $scheme;",
    ]
    if route.websocket:
        return [*headers, "proxy_set_header Upgrade $http_upgrade;", "proxy_set_header Connection $connection_upgrade;"]
    return [*headers, 'proxy_set_header Connection "";']


def _location(route: Route) -> str:
    lines = [f"# {route.why}", f"proxy_pass http://gantry_{route.server};", *_headers(route)]
    if route.streams or route.websocket:
        lines += ["proxy_buffering off;", f"proxy_read_timeout {STREAM_READ_TIMEOUT_S}s;"]
    if route.streams:
        lines.append("proxy_request_buffering off;")
    body = "\n".join(f"            {line}" for line in lines)
    return f"        location {route.location} {{\n{body}\n        }}"


def nginx_config(*, listen: str, pages: str, web: str, live: str, run_dir: Path | None = None) -> str:
    """A whole nginx.conf: ``listen`` (``[address:]port``) in front of the three
    servers' ``host:port``. With ``run_dir``, nginx keeps its pid, temporary files
    and error log there and stays in the foreground (a supervisor's child, a test)."""
    where = {"pages": pages, "web": web, "live": live}
    for name, address in where.items():
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--{name}: {address!r} is not host:port")
    if not listen.rpartition(":")[2].isdigit():
        raise ValueError(f"--listen: {listen!r} is not [address:]port")
    top = ["worker_processes auto;"]
    temp = []
    if run_dir is not None:
        top += ["daemon off;", f"pid {run_dir}/nginx.pid;", f"error_log {run_dir}/error.log warn;"]
        temp = [f"{kind}_temp_path {run_dir}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")]
    upstreams = "\n".join(
        f"    upstream gantry_{name} {{\n        server {where[name]};\n"
        + (f"        keepalive {KEEPALIVE_CONNECTIONS};\n" if name != "live" else "")
        + "    }"
        for name in SERVERS
    )
    http = [
        "access_log off;" if run_dir is None else f"access_log {run_dir}/access.log;",
        *temp,
        # Uploads go to the API (a checkpoint's files are registered by path, not uploaded).
        "client_max_body_size 16m;",
        "proxy_http_version 1.1;",
        "map $http_upgrade $connection_upgrade {\n        default upgrade;\n        '' close;\n    }",
    ]
    locations = "\n".join(_location(route) for route in ROUTES)
    return (
        "# Gantry behind one address (gantry proxy-config; controlplane/proxy.py says what goes where).\n"
        + "\n".join(top)
        + "\nevents {\n    worker_connections 4096;\n}\nhttp {\n"
        + "\n".join(f"    {line}" for line in http)
        + f"\n{upstreams}\n    server {{\n        listen {listen};\n{locations}\n    }}\n}}\n"
    )
