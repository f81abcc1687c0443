"""Every list under /api/: pages, constant queries, strict parameters, cursors."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from core import events
from deployments.models import DeploymentRevision, EngineBuild, MetricSample, RegisteredModel
from deployments.services import builds, telemetry
from gateway import services as gateway
from gateway.models import Alias, Usage
from tests import factories


@pytest.fixture
def world(api, llama, minilm, host, operator) -> dict[str, Any]:  # noqa: ANN001
    deployment = factories.deployment(host=host, user=operator)
    build, _ = builds.build_request(model="llama", host="h100-host", image=factories.IMAGE, spec={}, user=operator)
    key = gateway.key_create(name="k", user=operator, all_aliases=True).key
    Alias.objects.create(name="scoped", deployment=deployment, triton_name="minilm")
    return {"deployment": deployment, "build": build, "host": host, "key": key, "user": operator, "llama": llama}


def _grow_hosts(w: dict[str, Any], i: int) -> None:
    factories.gpu_host(f"h{i}", count=2)


def _grow_models(w: dict[str, Any], i: int) -> None:
    RegisteredModel.objects.create(name=f"m{i}", kind="embedding", path=f"/m{i}", host=w["host"], created_by=w["user"])


def _grow_builds(w: dict[str, Any], i: int) -> None:
    build = EngineBuild.objects.get(pk=w["build"].pk)
    build.pk, build.cache_key = None, f"{i:064d}"
    build.save()


def _grow_deployments(w: dict[str, Any], i: int) -> None:
    factories.deployment(host=w["host"], user=w["user"], name=f"d{i}")


def _grow_events(w: dict[str, Any], i: int) -> None:
    events.record(kind="test.event", source="test", deployment=w["deployment"], host=w["host"], build=w["build"])


def _grow_log(w: dict[str, Any], i: int) -> None:
    telemetry.log_lines_append(deployment_id=w["deployment"].pk, lines=[f"line {i}"])


def _grow_build_log(w: dict[str, Any], i: int) -> None:
    builds.build_log_append(build_id=w["build"].pk, lines=[f"line {i}"])


def _grow_metrics(w: dict[str, Any], i: int) -> None:
    MetricSample.objects.create(deployment=w["deployment"], kind="model", subject="minilm", values={"n": i})


def _grow_revisions(w: dict[str, Any], i: int) -> None:
    DeploymentRevision.objects.create(deployment=w["deployment"], generation=100 + i, spec=[], created_by=w["user"])


def _grow_aliases(w: dict[str, Any], i: int) -> None:
    Alias.objects.create(name=f"a{i}", deployment=w["deployment"], triton_name="minilm", created_by=w["user"])


def _grow_keys(w: dict[str, Any], i: int) -> None:
    gateway.key_create(name=f"k{i}", user=w["user"], alias_names=["scoped"])


def _grow_usage(w: dict[str, Any], i: int) -> None:
    Usage.objects.create(key=w["key"], alias="a", day=datetime.date(2026, 1, 1) + datetime.timedelta(days=i))


LISTS: dict[str, Callable[[dict[str, Any], int], None]] = {
    "/api/hosts/": _grow_hosts,
    "/api/models/": _grow_models,
    "/api/builds/": _grow_builds,
    "/api/builds/{build}/events/": _grow_events,
    "/api/builds/{build}/log/": _grow_build_log,
    "/api/deployments/": _grow_deployments,
    "/api/deployments/{deployment}/events/": _grow_events,
    "/api/deployments/{deployment}/log/": _grow_log,
    "/api/deployments/{deployment}/metrics/": _grow_metrics,
    "/api/deployments/{deployment}/revisions/": _grow_revisions,
    "/api/events/": _grow_events,
    "/api/gateway/aliases/": _grow_aliases,
    "/api/gateway/keys/": _grow_keys,
    "/api/gateway/usage/": _grow_usage,
}


def _url(template: str, w: dict[str, Any]) -> str:
    return template.format(deployment=w["deployment"].pk, build=w["build"].pk)


@pytest.mark.parametrize("template", LISTS)
def test_a_list_takes_the_same_queries_for_a_few_rows_or_a_full_page(template, api, world):  # noqa: ANN001
    url, grow = _url(template, world), LISTS[template]
    grow(world, 0)
    with CaptureQueriesContext(connection) as few:
        small = api.get(url, {"limit": 5})
    for i in range(1, 60):
        grow(world, i)
    with CaptureQueriesContext(connection) as many:
        full = api.get(url, {"limit": 50})
    assert small.status_code == full.status_code == 200, full.data
    assert len(full.data["results"]) == 50 and full.data["next"]
    assert len(many) == len(few), [q["sql"][:120] for q in many]


@pytest.mark.parametrize("template", LISTS)
def test_a_list_refuses_unknown_parameters_and_bad_pages_by_name(template, api, world):  # noqa: ANN001
    url = _url(template, world)
    response = api.get(url, {"limti": 5, "limit": 0, "ordering": "password"})
    assert response.status_code == 400
    assert set(response.data["errors"]) == {"limti", "limit", "ordering"}, response.data


def test_a_cursor_walk_sees_every_event_once_while_new_ones_arrive(api, world):  # noqa: ANN001
    for i in range(7):
        _grow_events(world, i)
    seen: list[int] = []
    url: str | None = f"/api/deployments/{world['deployment'].pk}/events/?limit=3"
    while url:
        page = api.get(url).data
        seen += [row["id"] for row in page["results"]]
        _grow_events(world, 99)  # lands before the first page: a walk newest-first never meets it
        url = page["next"]
    assert len(seen) == len(set(seen)) and seen == sorted(seen, reverse=True)
    created = [e["id"] for e in api.get(f"/api/deployments/{world['deployment'].pk}/events/?limit=500").data["results"]]
    assert set(seen) <= set(created) and min(created) == min(seen)


def test_after_reads_only_what_came_since_a_known_event(api, world):  # noqa: ANN001
    _grow_events(world, 0)
    known = api.get("/api/events/?limit=1").data["results"][0]["id"]
    _grow_events(world, 1)
    _grow_events(world, 2)
    newer = api.get(f"/api/events/?after={known}&deployment={world['deployment'].pk}").data["results"]
    assert [e["id"] > known for e in newer] == [True, True]


def test_events_filter_by_kind_prefix_and_actor(api, world, operator):  # noqa: ANN001
    by_user = api.get("/api/events/", {"actor": operator.username}).data["results"]
    assert by_user and all(e["source"] == f"user:{operator.username}" for e in by_user)
    builds_only = api.get("/api/events/", {"kind": "build."}).data["results"]
    assert builds_only and all(e["kind"].startswith("build.") for e in builds_only)


def test_a_filter_with_a_bad_value_is_refused_by_name(api, world):  # noqa: ANN001
    response = api.get("/api/builds/", {"status": "exploded"})
    assert response.status_code == 400 and "status" in response.data["errors"]
    assert api.get("/api/builds/", {"status": "pending"}).data["results"][0]["id"] == world["build"].pk


def test_the_query_check_skips_the_serializer_only_where_it_could_not_refuse_anything():
    from django.http import QueryDict
    from rest_framework import serializers
    from rest_framework.exceptions import ValidationError

    from core.api.lists import checked_query

    class Filters(serializers.Serializer):
        kind = serializers.CharField(required=False)

    class Needs(serializers.Serializer):
        ids = serializers.CharField()

    class Defaulted(serializers.Serializer):
        target = serializers.CharField(default="gateway")

    assert checked_query(Filters, QueryDict("")) == {}
    assert checked_query(Filters, QueryDict("kind=x")) == {"kind": "x"}
    with pytest.raises(ValidationError) as unknown:
        checked_query(Filters, QueryDict("knd=x"))
    assert unknown.value.detail == {"knd": ["is not a known query parameter"]}
    with pytest.raises(ValidationError) as missing:
        checked_query(Needs, QueryDict(""))
    assert "ids" in missing.value.detail
    assert checked_query(Defaulted, QueryDict("")) == {"target": "gateway"}


def test_a_cursor_the_list_did_not_give_is_a_400_naming_it(api, world):  # noqa: ANN001
    response = api.get("/api/events/?cursor=zzz")
    assert response.status_code == 400
    assert "cursor" in response.json()["errors"], response.json()
