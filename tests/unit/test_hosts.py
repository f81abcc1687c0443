from datetime import timedelta

from django.utils import timezone

from deployments import services
from deployments.models import Event, GpuHost


def test_first_beat_registers_the_host_with_its_gpus(gpu_host):
    assert gpu_host.gpus.get().compute_capability == "9.0"
    assert Event.objects.filter(host=gpu_host, kind="host.registered").count() == 1


def test_a_gpu_gone_from_the_inventory_is_removed(gpu_host):
    services.host_heartbeat(name="gpu-host", gpus=[])
    assert not gpu_host.gpus.exists()


def test_silent_host_is_marked_offline_once_and_back_online_on_its_next_beat(host, settings):
    GpuHost.objects.filter(pk=host.pk).update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    assert services.hosts_sweep() == ["cpu-host"]
    assert services.hosts_sweep() == []
    host.refresh_from_db()
    assert host.offline_since is not None and not host.is_online
    assert Event.objects.filter(host=host, kind="host.offline").count() == 1

    services.host_heartbeat(name="cpu-host", gpus=[])
    host.refresh_from_db()
    assert host.offline_since is None and host.is_online
    assert Event.objects.filter(host=host, kind="host.online").count() == 1


def test_live_host_is_not_swept(host):
    assert services.hosts_sweep() == []


def test_deployments_of_an_offline_host_show_unknown_and_keep_their_status(api, host, minilm):
    created = api.post(
        "/api/deployments/", {"name": "d", "host": "cpu-host", "models": [{"model": "minilm"}]}, format="json"
    )
    api.post(f"/api/deployments/{created.data['id']}/start/")
    GpuHost.objects.filter(pk=host.pk).update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    shown = api.get(f"/api/deployments/{created.data['id']}/").data
    assert (shown["status"], shown["shown_status"], shown["host_online"]) == ("launching", "unknown", False)


def test_log_lines_keep_the_newest_and_the_api_serves_them(api, host, minilm, settings, monkeypatch):
    monkeypatch.setattr(services, "LOG_LINES_KEPT", 5)
    created = api.post(
        "/api/deployments/", {"name": "d", "host": "cpu-host", "models": [{"model": "minilm"}]}, format="json"
    )
    services.log_lines_append(deployment_id=created.data["id"], lines=[f"line {i}" for i in range(8)])
    assert api.get(f"/api/deployments/{created.data['id']}/log/?lines=3").data["lines"] == [
        "line 5",
        "line 6",
        "line 7",
    ]
    assert api.get(f"/api/deployments/{created.data['id']}/log/?lines=0").status_code == 400
