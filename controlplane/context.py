"""Every page knows where the browser finds the live (websocket) server, and Gantry's version."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest

from common.version import gantry_version


def live(request: HttpRequest) -> dict[str, str]:
    return {"live_port": settings.GANTRY_LIVE_PORT, "gantry_version": gantry_version()}
