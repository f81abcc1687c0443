"""Removing what a deleted deployment or build left on its host: the row is gone,
so a failure is said on the host's timeline, with its cause."""

from __future__ import annotations

from core.models import Event
from hosts.services import hosts
from workers import tasks
from workers.deploy.plan import deployment_root
from workers.engines.run import work_dir


def test_files_that_cannot_be_removed_are_on_the_hosts_timeline(db, settings, tmp_path):  # noqa: ANN001
    settings.GANTRY_DATA_DIR = tmp_path
    host = hosts.host_heartbeat(name=settings.GANTRY_HOST_NAME, gpus=[])
    # What rmtree cannot remove: a file where the deployment's folder should be.
    root = deployment_root(41, "gone")
    root.parent.mkdir(parents=True, exist_ok=True)
    root.write_text("not a folder")
    build_root = work_dir(42)
    build_root.parent.mkdir(parents=True, exist_ok=True)
    build_root.write_text("not a folder")

    tasks.forget_deployment(41, "gone")
    tasks.forget_build(42)

    messages = list(Event.objects.filter(host=host, kind="host.cleanup_failed").values_list("message", flat=True))
    assert len(messages) == 2
    assert messages[0].startswith("removing the files of deleted deployment gone failed: [Errno 20] Not a directory")
    assert messages[1].startswith("removing the files of deleted build 42 failed: [Errno 20] Not a directory")
