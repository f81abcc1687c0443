"""Server log lines and metric samples: the newest kept, served over the API."""

from __future__ import annotations

from deployments.services import telemetry


def test_log_lines_keep_the_newest_and_the_api_serves_them(api, host, minilm, settings, monkeypatch):
    monkeypatch.setattr(telemetry, "LOG_LINES_KEPT", 5)
    created = api.post(
        "/api/deployments/", {"name": "d", "host": "cpu-host", "models": [{"model": "minilm"}]}, format="json"
    )
    telemetry.log_lines_append(deployment_id=created.data["id"], lines=[f"line {i}" for i in range(8)])
    newest = api.get(f"/api/deployments/{created.data['id']}/log/?limit=3").data["results"]
    assert [row["line"] for row in newest] == ["line 7", "line 6", "line 5"]
    oldest_kept = api.get(f"/api/deployments/{created.data['id']}/log/?ordering=id&limit=1").data["results"]
    assert [row["line"] for row in oldest_kept] == ["line 3"]
    refused = api.get(f"/api/deployments/{created.data['id']}/log/?limit=0")
    assert refused.status_code == 400 and "limit" in refused.data["errors"]


def test_each_models_readiness_is_kept_and_pushed_each_check(api, host, minilm, operator, monkeypatch):
    from core import events
    from tests import factories

    deployment = factories.deployment(host=host, name="r", models=["minilm"], user=operator)
    factories.deployment_in(deployment, "launching", "loading", "ready")
    replica = factories.replica_of(deployment).pk
    pushed = []
    monkeypatch.setattr(events, "publish", lambda group, message: pushed.append((group, message)))
    # An engine's helper models are not placements: left out.
    assert telemetry.placements_readiness(replica_id=replica, models={"minilm": True, "x-engine": True}) == {
        "minilm": True
    }
    assert telemetry.placements_readiness(replica_id=replica, models={"minilm": True}) == {}
    assert telemetry.placements_readiness(replica_id=replica, models={"minilm": False}) == {"minilm": False}
    assert [message["ready"] for _, message in pushed] == [{"minilm": True}, {"minilm": True}, {"minilm": False}]
    [model] = api.get(f"/api/deployments/{deployment.pk}/").data["models"]
    assert model["ready"] is False
