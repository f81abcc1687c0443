"""Build requests: the cache, joined requests, cancel, the reaper, claiming once."""

from __future__ import annotations

import threading
from datetime import timedelta

from django.db import connection
from django.utils import timezone

from core.models import Event
from deployments.models import BuildStatus, EngineBuild
from deployments.services import builds
from tests import factories
from workers.engines import run


def request(operator, **spec):  # noqa: ANN001, ANN003, ANN201
    return builds.build_request(model="llama", host="h100-host", image=factories.IMAGE, spec=spec, user=operator)


def test_concurrent_identical_requests_start_one_build(transactional_db, operator, builder_images, tmp_path):
    host = factories.trtllm_host("h100-host", "9.0")
    factories.registered_model(
        name="llama", kind="llm", path=factories.write_checkpoint(tmp_path / "l", factories.LLAMA), host=host
    )
    barrier = threading.Barrier(4)
    results = []

    def ask() -> None:
        barrier.wait()
        try:
            results.append(request(operator)[1])
        finally:
            connection.close()

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert EngineBuild.objects.count() == 1
    assert sorted(results).count("queued") == 1 and len(results) == 4


def test_pending_build_cancels_at_once_and_running_one_is_asked_to_stop(llama, operator):
    pending, _ = request(operator)
    assert builds.build_cancel(build_id=pending.pk, user=operator).status == BuildStatus.CANCELLED
    running, _ = request(operator, max_batch_size=4)
    builds.build_claim(build_id=running.pk, source="worker:h100-host", output_dir="/x")
    assert builds.build_cancel(build_id=running.pk, user=operator).status == BuildStatus.CANCELLING
    ended = builds.build_finish(build_id=running.pk, to=BuildStatus.FAILED, source="worker:h100-host", message="killed")
    assert ended.status == BuildStatus.CANCELLED


def test_build_whose_worker_went_quiet_is_failed_by_the_reaper(llama, operator):
    build, _ = request(operator)
    builds.build_claim(build_id=build.pk, source="worker:h100-host", output_dir="/x")
    assert builds.builds_reap() == []
    EngineBuild.objects.filter(pk=build.pk).update(heartbeat_at=timezone.now() - timedelta(minutes=10))
    assert builds.builds_reap() == [build.pk]
    build.refresh_from_db()
    assert build.status == BuildStatus.FAILED and "stopped reporting" in build.status_message


def test_second_delivery_of_a_claimed_build_does_nothing(llama, operator):
    build, _ = request(operator)
    assert builds.build_claim(build_id=build.pk, source="worker:h100-host", output_dir="/x") is not None
    assert builds.build_claim(build_id=build.pk, source="worker:h100-host", output_dir="/x") is None
    run.run_build(build.pk)  # a redelivered task: the row is running, so nothing starts
    assert list(Event.objects.filter(build=build, kind="build.status").values_list("to_status", flat=True)) == [
        "running"
    ]
    assert not run.work_dir(build.pk).exists()
