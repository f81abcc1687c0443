"""One websocket consumer: authenticate in connect(), check the object exists,
join its group, say where the group's numbering stands (a "hello"), and
forward what services publish. Read-only: the browser acts through the REST
API. With the hello, a page can tell a message lost right after it connected
from one published before (core.events numbers them)."""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from common import metrics
from core import events
from core.permissions import can_view
from deployments.models import Deployment, EngineBuild

TOPICS = {"deployment": (Deployment, events.deployment_group), "build": (EngineBuild, events.build_group)}
# The dashboard follows the deployments in view: at most this many, and the
# sequence numbers it leaves out are named in batches of at most SKIPPED_BATCH.
WATCH_MAX = 500
SKIPPED_BATCH = 200


class LiveConsumer(AsyncJsonWebsocketConsumer):
    group: str = ""
    last_seq: int | None = None  # the last number this socket got: a jump is messages the layer dropped
    watch: frozenset[int] | None = None  # the dashboard's deployments in view (None: all)
    skipped: list[int]

    async def connect(self) -> None:
        user = self.scope.get("user")
        if not can_view(user):
            await self.close(code=4401)
            return
        kwargs = self.scope["url_route"]["kwargs"]
        if kwargs["topic"] == "dashboard":
            self.group = events.DASHBOARD_GROUP
        else:
            model, group_of = TOPICS[kwargs["topic"]]
            if not await database_sync_to_async(model.objects.filter(pk=kwargs["pk"]).exists)():
                await self.close(code=4404)
                return
            self.group = group_of(kwargs["pk"])
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        metrics.gauge_add(metrics.LIVE_SOCKETS, 1)
        # Read after joining: every later number reaches this socket, or shows as a gap.
        seq = await events.current_seq(self.channel_layer.connection(0), self.group)
        self.last_seq = seq
        await self.send_json({"type": "hello", "group": self.group, "seq": seq})

    async def disconnect(self, code: int) -> None:
        if self.group:
            await self.channel_layer.group_discard(self.group, self.channel_name)
            metrics.gauge_add(metrics.LIVE_SOCKETS, -1)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """Only the dashboard's {"watch": [deployment ids in view]}: commands go through the REST API."""
        if self.group == events.DASHBOARD_GROUP and isinstance(content, dict) and list(content) == ["watch"]:
            ids = content["watch"]
            if isinstance(ids, list) and len(ids) <= WATCH_MAX and all(type(i) is int for i in ids):
                self.watch, self.skipped = frozenset(ids), []
                await self.send_json({"type": "watching", "deployments": len(self.watch)})
                return
            await self.send_json({"type": "error", "detail": f"watch: a list of at most {WATCH_MAX} deployment ids"})
            return
        await self.send_json({"type": "error", "detail": "this socket is read-only; use the REST API"})

    async def gantry_message(self, message: dict[str, Any]) -> None:
        payload = message["payload"]
        self._count(payload.get("seq"))
        deployment = payload.get("deployment")
        if self.watch is not None and deployment is not None and deployment not in self.watch:
            # Not in view: left out, and its number named so the page sees no gap.
            if isinstance(payload.get("seq"), int):
                self.skipped.append(payload["seq"])
            if len(self.skipped) >= SKIPPED_BATCH:
                await self.send_json({"type": "skipped", "seqs": self.skipped})
                self.skipped = []
            return
        if self.watch is not None and self.skipped:
            payload = {**payload, "skipped": self.skipped}
            self.skipped = []
        await self.send_json(payload)

    def _count(self, seq: Any) -> None:
        """One message more for /metrics, and those its number says never came."""
        if not isinstance(seq, int):
            return
        if self.last_seq is not None and seq > self.last_seq + 1:
            metrics.count(metrics.LIVE_MESSAGES_LOST, "socket", amount=seq - self.last_seq - 1)
        self.last_seq = max(seq, self.last_seq or 0)
        metrics.count(metrics.LIVE_MESSAGES)
