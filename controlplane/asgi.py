"""ASGI entry points (controlplane.serving says which server runs which):

- ``http_application``: Django, with two doors in front of it that skip
  Django's request path: the OpenAI-compatible gateway (/v1/..., gateway.app)
  and token-authenticated generate requests (playground.lean);
- ``websocket_application``: the Channels consumers (the live server);
- ``application``: both in one process, for a single-process setup.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
# The servers borrow PostgreSQL connections from a pool (see settings).
os.environ.setdefault("DATABASE_POOL_SIZE", "8")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from deployments.routing import websocket_urlpatterns  # noqa: E402
from deployments.ws_auth import TokenOrSessionAuthMiddlewareStack  # noqa: E402
from gateway.app import GatewayRouter  # noqa: E402
from playground.lean import InferenceRouter  # noqa: E402

http_application = GatewayRouter(InferenceRouter(django_asgi_app))
_websockets = AllowedHostsOriginValidator(TokenOrSessionAuthMiddlewareStack(URLRouter(websocket_urlpatterns)))
websocket_application = ProtocolTypeRouter({"websocket": _websockets})
application = ProtocolTypeRouter({"http": http_application, "websocket": _websockets})
