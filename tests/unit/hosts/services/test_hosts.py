"""Host heartbeats, GPU inventory, and the offline sweep."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from core.models import Event
from hosts.models import GpuHost
from hosts.services import hosts


def test_first_beat_registers_the_host_with_its_gpus(gpu_host):
    assert gpu_host.gpus.get().compute_capability == "9.0"
    assert Event.objects.filter(host=gpu_host, kind="host.registered").count() == 1


def test_a_gpu_gone_from_the_inventory_is_removed(gpu_host):
    hosts.host_heartbeat(name="gpu-host", gpus=[])
    assert not gpu_host.gpus.exists()


def test_silent_host_is_marked_offline_once_and_back_online_on_its_next_beat(host, settings):
    GpuHost.objects.filter(pk=host.pk).update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    assert hosts.hosts_sweep() == ["cpu-host"]
    assert hosts.hosts_sweep() == []
    host.refresh_from_db()
    assert host.offline_since is not None and not host.is_online
    assert Event.objects.filter(host=host, kind="host.offline").count() == 1

    hosts.host_heartbeat(name="cpu-host", gpus=[])
    host.refresh_from_db()
    assert host.offline_since is None and host.is_online
    assert Event.objects.filter(host=host, kind="host.online").count() == 1


def test_live_host_is_not_swept(host):
    assert hosts.hosts_sweep() == []


def test_the_pages_of_a_host_s_deployments_are_told_when_it_goes_and_comes_back(
    host, minilm, operator, monkeypatch, django_capture_on_commit_callbacks
):
    from core import events
    from tests import factories

    deployment = factories.deployment_in(factories.deployment(host=host, user=operator), "launching")
    told: list[tuple[str, dict]] = []
    monkeypatch.setattr(events, "publish", lambda group, payload: told.append((group, payload)))
    GpuHost.objects.filter(pk=host.pk).update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    with django_capture_on_commit_callbacks(execute=True):
        hosts.hosts_sweep()
    with django_capture_on_commit_callbacks(execute=True):
        hosts.host_heartbeat(name=host.name, gpus=[])
    to_page = [payload for group, payload in told if group == events.deployment_group(deployment.pk)]
    assert [(p["type"], p["online"]) for p in to_page if p["type"] == "host"] == [("host", False), ("host", True)]
