"""manage.py gantry_serve web|live [--bind A] [--port P] [--workers N]: run one
of Gantry's two servers as controlplane.serving composes it (docker-compose.yml
and a GPU-less control-plane host use this)."""

from __future__ import annotations

import os
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.serving import live_argv, port_taken, web_argv


class Command(BaseCommand):
    help = "Run the web server (pages, API, gateway) or the live server (websockets)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("server", choices=["web", "live"])
        parser.add_argument("--bind", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=None, help="default 8000 for web, 8001 for live")
        parser.add_argument("--workers", type=int, default=None, help="web processes (GANTRY_WEB_WORKERS)")

    def handle(self, *args: Any, server: str, bind: str, port: int | None, workers: int | None, **options: Any) -> None:
        port = port or (8000 if server == "web" else 8001)
        if port_taken(bind, port):
            raise CommandError(f"--port: {bind}:{port} is in use already (another Gantry server?); pick another")
        if server == "web":
            argv = web_argv(sys.executable, bind=bind, port=port, workers=workers)
        else:
            argv = live_argv(sys.executable, bind=bind, port=port)
        scheme = "http" if server == "web" else "ws"
        self.stdout.write(f"gantry {server}: listening on {scheme}://{bind}:{port}/")
        sys.stdout.flush()
        os.execv(sys.executable, argv)  # the server replaces this process: signals reach it directly
