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
