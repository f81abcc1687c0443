"""The floor of bench/live.py: a minimal Channels consumer (accept, join the
group named in its path, forward what is sent to it; no auth, no database) on
the same daphne and the same Redis channel layer as Gantry's live consumer."""

from channels.generic.websocket import AsyncWebsocketConsumer
from channels.routing import ProtocolTypeRouter, URLRouter
from django.urls import path

from controlplane.asgi import _websockets as gantry_websockets


class FloorConsumer(AsyncWebsocketConsumer):
    async def connect(self) -> None:
        self.group = self.scope["url_route"]["kwargs"]["group"]
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(self.group, self.channel_name)

    async def floor_message(self, message: dict) -> None:
        await self.send(text_data=message["text"])


class _Split:
    """/floor/ws/<group>/ to the floor consumer, everything else to Gantry's."""

    def __init__(self) -> None:
        self.floor = URLRouter([path("floor/ws/<str:group>/", FloorConsumer.as_asgi())])

    async def __call__(self, scope, receive, send):  # noqa: ANN001, ANN204
        target = self.floor if scope["path"].startswith("/floor/") else gantry_websockets
        return await target(scope, receive, send)


application = ProtocolTypeRouter({"websocket": _Split()})
