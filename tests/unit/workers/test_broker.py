"""The broker as the host agent sees it, against the real Redis: an outage and
the broker's return on the host's timeline, the outbox relayed once it
answers, and a restart (a new run id) re-driving what each passing row waits
for. Celery's send is replaced at its seam (tests/unit/hosts/test_outbox.py)."""

from __future__ import annotations

import pytest

from core import queues
from core.models import Event
from deployments.services import deployments, registered_models
from gateway.models import Alias, ApiKey
from hosts import outbox
from hosts.models import GpuHost, OutboxMessage
from hosts.services import hosts
from loadtests import runs
from loadtests import services as loadtest_services
from tests import factories
from tests.unit.hosts.test_outbox import Broker
from workers import broker


@pytest.fixture
def sent(monkeypatch):  # noqa: ANN001, ANN201
    fake = Broker()
    monkeypatch.setattr(outbox, "current_app", fake)
    monkeypatch.setattr(outbox, "send_soon", lambda message_id: None)  # the relay sends here, not a thread
    return fake.sent


def _host_events(settings, kind: str) -> list[str]:  # noqa: ANN001
    return list(Event.objects.filter(host__name=settings.GANTRY_HOST_NAME, kind=kind).values_list("message", flat=True))


def test_an_outage_and_the_return_are_said_once_and_what_waited_is_sent(settings, db, sent):
    hosts.host_heartbeat(name=settings.GANTRY_HOST_NAME, gpus=[])
    outbox.enqueue_on_commit(queues.INSPECT_MODEL, host_name=settings.GANTRY_HOST_NAME, args=[1])
    watch = broker.BrokerWatch()
    real_broker = settings.CELERY_BROKER_URL
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    watch.beat()
    watch.beat()
    assert len(_host_events(settings, "host.broker_unreachable")) == 1
    assert sent == [] and OutboxMessage.objects.count() == 1
    settings.CELERY_BROKER_URL = real_broker
    watch.beat()
    assert "reachable again" in _host_events(settings, "host.broker_back")[0]
    assert sent == [(queues.INSPECT_MODEL, [1], queues.host_queue(settings.GANTRY_HOST_NAME))]
    assert not OutboxMessage.objects.exists()


def test_a_broker_restart_sends_again_what_each_passing_row_waits_for(settings, minilm, operator, sent):
    host = minilm.host
    settings.GANTRY_HOST_NAME = host.name
    launching = factories.deployment(host=host, name="launching", user=operator)
    deployments.deployment_start(deployment_id=launching.pk, user=operator)
    model = registered_models.model_register(name="pending", kind="embedding", path=minilm.path, host=host.name)
    serving = factories.deployment_in(factories.deployment(host=host, name="serving", user=operator),
                                      "launching", "loading", "ready")  # fmt: skip
    Alias.objects.create(name="embed", deployment=serving, triton_name="minilm")
    run = loadtest_services.run_create(
        deployment_id=serving.pk, alias="embed", spec={"request_count": 5}, user=operator
    )
    OutboxMessage.objects.all().delete()  # all of it was sent, then lost with the broker's queues
    watch = broker.BrokerWatch()
    watch.beat()  # the first run id this host sees: nothing to re-drive
    assert sent == []
    GpuHost.objects.filter(pk=host.pk).update(broker_run_id="a-run-before-the-restart")
    watch.beat()
    queue = queues.host_queue(host.name)
    # The load test's task again, with a new gateway key (the first one's secret is gone with the message).
    key = ApiKey.objects.get(name=f"{runs.KEY_NAME_PREFIX}{run.pk}", revoked_at=None)
    (again,) = [args for task, args, _ in sent if task == queues.RUN_LOADTEST]
    assert again[0] == run.pk and again[1].startswith(key.prefix)
    assert sorted((task, args[:1], q) for task, args, q in sent) == sorted(
        [
            (queues.LAUNCH_REPLICA, [factories.replica_of(launching).pk], queue),
            (queues.INSPECT_MODEL, [model.pk], queue),
            (queues.RUN_LOADTEST, [run.pk], queues.jobs_queue(host.name)),
        ]
    )
    (note,) = _host_events(settings, "host.redrive")
    assert "the broker restarted" in note and "deployment launching" in note and "inspection of pending" in note
    assert f"load test {run.pk}" in note
    watch.beat()  # the same run again: nothing more
    assert len(sent) == 3
