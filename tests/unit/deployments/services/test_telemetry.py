"""Server log lines and metric samples: the newest kept, served over the API."""

from __future__ import annotations

from deployments.services import telemetry


def test_log_lines_keep_the_newest_and_the_api_serves_them(api, host, minilm, settings, monkeypatch):
    monkeypatch.setattr(telemetry, "LOG_LINES_KEPT", 5)
    created = api.post(
        "/api/deployments/", {"name": "d", "host": "cpu-host", "models": [{"model": "minilm"}]}, format="json"
    )
    telemetry.log_lines_append(deployment_id=created.data["id"], lines=[f"line {i}" for i in range(8)])
    assert api.get(f"/api/deployments/{created.data['id']}/log/?lines=3").data["lines"] == [
        "line 5",
        "line 6",
        "line 7",
    ]
    assert api.get(f"/api/deployments/{created.data['id']}/log/?lines=0").status_code == 400
