"""ASGI entry point: Django for HTTP, with two doors in front of it that skip
Django's request path: the OpenAI-compatible gateway (/v1/..., gateway.app)
and token-authenticated generate requests (playground.lean); Channels for
websockets."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from deployments.routing import websocket_urlpatterns  # noqa: E402
from deployments.ws_auth import TokenOrSessionAuthMiddlewareStack  # noqa: E402
from gateway.app import GatewayRouter  # noqa: E402
from playground.lean import InferenceRouter  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": GatewayRouter(InferenceRouter(django_asgi_app)),
        "websocket": AllowedHostsOriginValidator(TokenOrSessionAuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
