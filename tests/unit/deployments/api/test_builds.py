"""/api/builds/: request, reuse and field errors."""

from __future__ import annotations

from core.models import Event
from deployments.models import EngineBuild
from tests import factories


def test_build_api_refuses_bad_types_and_names_the_field(api, llama):
    response = api.post(
        "/api/builds/",
        {"model": "llama", "host": "h100-host", "image": factories.IMAGE, "spec": {"dtype": "fp64"}},
        format="json",
    )
    assert response.status_code == 400
    assert response.data["code"] == "invalid" and response.data["status"] == 400
    assert response.data["errors"] == {"spec.dtype": ['"fp64" is not a valid choice.']}


def test_identical_request_returns_the_succeeded_build_and_force_rebuilds(api, llama):
    body = {"model": "llama", "host": "h100-host", "image": factories.IMAGE, "spec": {"max_batch_size": 16}}
    first = api.post("/api/builds/", body, format="json")
    assert first.status_code == 201 and first.data["how"] == "queued"
    joined = api.post("/api/builds/", body, format="json")
    assert joined.status_code == 200 and joined.data["how"] == "joined" and joined.data["id"] == first.data["id"]
    factories.succeeded_build(EngineBuild.objects.get(pk=first.data["id"]))
    again = api.post("/api/builds/", {**body, "spec": {"max_batch_size": 16, "gpu_ids": [1]}}, format="json")
    assert again.status_code == 200 and again.data["how"] == "cached" and again.data["id"] == first.data["id"]
    forced = api.post("/api/builds/", {**body, "force": True}, format="json")
    assert forced.status_code == 201 and forced.data["id"] != first.data["id"] and forced.data["forced"]
    other = api.post("/api/builds/", {**body, "spec": {"max_batch_size": 32}}, format="json")
    assert other.status_code == 201
    assert Event.objects.filter(kind="build.reused", build_id=first.data["id"]).count() == 1


def test_a_build_says_whether_it_can_still_be_cancelled(api, llama):
    body = {"model": "llama", "host": "h100-host", "image": factories.IMAGE}
    queued = api.post("/api/builds/", body, format="json")
    assert queued.data["actions"] == {"cancel": True}
    cancelled = api.post(f"/api/builds/{queued.data['id']}/cancel/")
    assert cancelled.data["status"] == "cancelled" and cancelled.data["actions"] == {"cancel": False}


def test_the_fast_build_rows_equal_drfs_own(api, llama, host, operator):  # noqa: ANN001
    from rest_framework import serializers

    from deployments import selectors
    from deployments.api.builds import BuildOut

    body = {"model": "llama", "host": "h100-host", "image": factories.IMAGE, "spec": {"max_batch_size": 4}}
    build = EngineBuild.objects.get(pk=api.post("/api/builds/", body, format="json").data["id"])
    factories.succeeded_build(build)
    EngineBuild.objects.filter(pk=build.pk).update(
        artifacts=[{"path": "rank0.engine", "size": 5, "sha256": "ab" * 32}], exit_code=0, hint="h",
        build_config={"max_batch_size": 4}, image_digest=factories.IMAGE_DIGEST,
    )  # fmt: skip
    for row in (build, EngineBuild.objects.create(model=llama, host=llama.host, cache_key="c" * 64)):
        loaded = selectors.build_list().get(pk=row.pk)
        fast = BuildOut(loaded).data
        generic = serializers.ModelSerializer.to_representation(BuildOut(loaded), loaded)
        assert dict(fast) == dict(generic) and list(fast) == list(generic)
        # The list writes the same from the values it reads (selectors.build_rows), its JSON
        # columns copied as stored (core.fields.StoredJSON): compared as the client reads them.
        listed = next(b for b in api.get("/api/builds/").json()["results"] if b["id"] == row.pk)
        assert listed == dict(generic) and list(listed) == list(generic)
        indented = api.get("/api/builds/", HTTP_ACCEPT="application/json; indent=2")
        assert b"\n" in indented.content and next(b for b in indented.json()["results"] if b["id"] == row.pk) == dict(
            generic
        )


def test_preflight_says_which_build_an_identical_request_would_reuse_and_writes_nothing(api, llama):
    body = {"model": "llama", "host": "h100-host", "image": factories.IMAGE, "spec": {"max_batch_size": 16}}
    fresh = api.post("/api/builds/preflight/", body, format="json")
    assert fresh.status_code == 200 and fresh.data["valid"] is True and fresh.data["reuse"] is None
    assert fresh.data["spec"]["max_batch_size"] == 16 and fresh.data["spec"]["dtype"]  # defaults filled in
    assert not EngineBuild.objects.exists()
    first = api.post("/api/builds/", body, format="json")
    assert first.data["cache_key"] == fresh.data["cache_key"]
    running = api.post("/api/builds/preflight/", body, format="json").data
    assert running["reuse"] == {"how": "joined", "build": first.data["id"]}
    factories.succeeded_build(EngineBuild.objects.get(pk=first.data["id"]))
    done = api.post("/api/builds/preflight/", body, format="json").data
    assert done["reuse"] == {"how": "cached", "build": first.data["id"]}
    forced = api.post("/api/builds/preflight/", {**body, "force": True}, format="json").data
    assert forced["reuse"] is None
    assert EngineBuild.objects.count() == 1 and not Event.objects.filter(kind="build.reused").exists()


def test_preflight_names_each_broken_rule(api, llama):
    body = {"model": "llama", "host": "h100-host", "image": factories.IMAGE, "spec": {"max_seq_len": 100_000}}
    answer = api.post("/api/builds/preflight/", body, format="json").data
    assert answer["valid"] is False and answer["reuse"] is None
    assert "max_position_embeddings" in " ".join(answer["errors"]["spec.max_seq_len"])
    nowhere = api.post("/api/builds/preflight/", {**body, "host": "nowhere"}, format="json").data
    assert nowhere["errors"] == {"host": ["no GPU host named 'nowhere'"]}
