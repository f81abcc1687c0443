"""The live websocket consumer over the real Redis channel layer: it refuses
anonymous users and unknown objects, joins the object's group, forwards what
services publish, and is read-only."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser

from core import events
from deployments.routing import websocket_urlpatterns
from tests import factories

pytestmark = pytest.mark.django_db(transaction=True)


def _connect(path: str, user) -> WebsocketCommunicator:  # noqa: ANN001
    communicator = WebsocketCommunicator(URLRouter(websocket_urlpatterns), path)
    communicator.scope["user"] = user
    return communicator


def test_anonymous_socket_is_refused_before_joining():
    async def run() -> tuple:
        communicator = _connect("/ws/dashboard/", AnonymousUser())
        connected, code = await communicator.connect()
        await communicator.disconnect()
        return connected, code

    assert async_to_sync(run)() == (False, 4401)


def test_socket_for_a_missing_deployment_is_refused(operator):
    async def run() -> tuple:
        communicator = _connect("/ws/deployments/999999/", operator)
        connected, code = await communicator.connect()
        await communicator.disconnect()
        return connected, code

    assert async_to_sync(run)() == (False, 4404)


def test_joined_socket_receives_what_is_published_to_its_deployment_only(operator, minilm):
    deployment = factories.deployment(host=minilm.host, user=operator)
    other = factories.deployment(host=minilm.host, user=operator, name="other")
    events.publisher().flush()  # their creation events are numbered and sent before the socket joins

    async def run() -> tuple:
        communicator = _connect(f"/ws/deployments/{deployment.pk}/", operator)
        connected, _ = await communicator.connect()
        hello = await communicator.receive_json_from(timeout=5)
        assert hello["type"] == "hello" and hello["group"] == events.deployment_group(deployment.pk)
        await communicator.send_json_to({"type": "start"})
        refusal = await communicator.receive_json_from(timeout=5)
        # Published from a worker's thread, as services do: to another deployment, then to this one.
        await _publish(events.deployment_group(other.pk), {"type": "log", "lines": ["not for us"]})
        await _publish(events.deployment_group(deployment.pk), {"type": "log", "lines": ["for us"]})
        forwarded = await communicator.receive_json_from(timeout=5)
        nothing_more = await communicator.receive_nothing(timeout=0.3)
        await communicator.disconnect()
        return connected, refusal, forwarded, nothing_more

    connected, refusal, forwarded, nothing_more = async_to_sync(run)()
    assert connected
    assert refusal == {"type": "error", "detail": "this socket is read-only; use the REST API"}
    group = events.deployment_group(deployment.pk)
    assert forwarded == {"type": "log", "lines": ["for us"], "group": group, "seq": forwarded["seq"]}
    assert nothing_more


def test_each_group_numbers_its_messages_so_a_lost_one_shows_as_a_gap(operator, minilm):
    deployment = factories.deployment(host=minilm.host, user=operator)
    events.publisher().flush()  # its creation event is numbered and sent before the socket joins
    group = events.deployment_group(deployment.pk)

    async def run() -> list[dict]:
        from channels.layers import get_channel_layer

        communicator = _connect(f"/ws/deployments/{deployment.pk}/", operator)
        await communicator.connect()
        hello = await communicator.receive_json_from(timeout=5)
        await _publish(group, {"type": "log", "lines": ["one"]})
        first = await communicator.receive_json_from(timeout=5)
        assert first["seq"] == hello["seq"] + 1  # the hello says where numbering stood as it joined
        # A message numbered but never delivered (the channel layer drops those silently).
        redis = get_channel_layer().connection(0)
        await redis.incr(events.seq_key(group))
        await _publish([group, events.DASHBOARD_GROUP], {"type": "log", "lines": ["three"]})
        third = await communicator.receive_json_from(timeout=5)
        await communicator.disconnect()
        return [first, third]

    first, third = async_to_sync(run)()
    assert third["seq"] == first["seq"] + 2
    assert third["group"] == group


async def _publish(group: str | list[str], payload: dict) -> None:
    from channels.db import database_sync_to_async

    await database_sync_to_async(events.publish)(group, payload)


def test_the_dashboard_follows_only_the_deployments_in_view_and_names_what_it_left_out(operator, minilm):
    events.publisher().flush()

    async def run() -> tuple:
        communicator = _connect("/ws/dashboard/", operator)
        await communicator.connect()
        hello = await communicator.receive_json_from(timeout=5)
        await communicator.send_json_to({"watch": [7, "x"]})
        refused = await communicator.receive_json_from(timeout=5)
        await communicator.send_json_to({"watch": [7]})
        watching = await communicator.receive_json_from(timeout=5)
        for deployment in (8, 9, 7):  # two rows out of view, then the one in view
            await _publish(events.DASHBOARD_GROUP, {"type": "rate", "deployment": deployment, "request_rate": 1.0})
        await _publish(events.DASHBOARD_GROUP, {"type": "gpus", "host": "h", "gpus": []})  # a host's beat: kept
        forwarded = [await communicator.receive_json_from(timeout=5) for _ in range(2)]
        await communicator.disconnect()
        return hello, refused, watching, forwarded

    hello, refused, watching, (rate, beat) = async_to_sync(run)()
    assert refused["type"] == "error" and "at most 500 deployment ids" in refused["detail"]
    assert watching == {"type": "watching", "deployments": 1}
    assert rate["deployment"] == 7 and rate["skipped"] == [hello["seq"] + 1, hello["seq"] + 2]
    assert rate["seq"] == hello["seq"] + 3 and beat["type"] == "gpus" and "skipped" not in beat
