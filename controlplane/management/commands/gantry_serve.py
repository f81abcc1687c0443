"""manage.py gantry_serve web|pages|live [--bind A] [--port P] [--workers N]: run
one of Gantry's servers as controlplane.serving composes it (docker-compose.yml
and a GPU-less control-plane host use this)."""

from __future__ import annotations

import os
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.proxy import DEFAULT_PORTS, PORTS_HELP
from controlplane.serving import live_argv, pages_argv, port_taken, web_argv


class Command(BaseCommand):
    help = "Run the web server (gateway, streams; every other door too), the pages server or the live server."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("server", choices=sorted(DEFAULT_PORTS))
        parser.add_argument("--bind", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=None, help=f"default {PORTS_HELP}")
        parser.add_argument("--workers", type=int, default=None, help="web or pages processes (GANTRY_WEB_WORKERS)")

    def handle(self, *args: Any, server: str, bind: str, port: int | None, workers: int | None, **options: Any) -> None:
        port = port or DEFAULT_PORTS[server]
        if port_taken(bind, port):
            raise CommandError(f"--port: {bind}:{port} is in use already (another Gantry server?); pick another")
        if server == "web":
            argv = web_argv(sys.executable, bind=bind, port=port, workers=workers)
        elif server == "pages":
            argv = pages_argv(sys.executable, bind=bind, port=port, workers=workers)
        else:
            argv = live_argv(sys.executable, bind=bind, port=port)
        scheme = "ws" if server == "live" else "http"
        self.stdout.write(f"gantry {server}: listening on {scheme}://{bind}:{port}/")
        sys.stdout.flush()
        os.execv(sys.executable, argv)  # the server replaces this process: signals reach it directly
