"""After a worker died mid-build: stop what it left on this host (a build
process or container) and fail its build, and remove build containers of no
running build. A succeeded build whose engine folder went missing or changed
is marked so, and never reused or served again."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from common.errors import GantryError
from deployments.models import BuildStatus as B
from deployments.models import EngineBuild
from deployments.services import builds
from workers import processes
from workers.engines.verify import engine_files_problem
from workers.jobs import source
from workers.runtimes import docker as docker_engine

log = logging.getLogger(__name__)

# A running build on this host whose worker has not heartbeated it for this long
# belongs to a worker that died: the agent stops what it left and fails it.
ORPHAN_AFTER_S = 20


def _process_of_build(handle: str, build_id: int) -> int | None:
    """The pid in ``handle`` if that process still runs this build (not a reused pid)."""
    if not handle.startswith("pid:"):
        return None
    pid = int(handle[4:])
    return pid if processes.is_ours(pid, env_contains=f"GANTRY_BUILD_ID={build_id}".encode()) else None


def reconcile_builds() -> None:
    """Stop what dead workers left behind on this host: builds still marked running
    whose heartbeat stopped are failed, and their containers or processes are
    stopped; build containers of no running build are removed."""
    cutoff = timezone.now() - timedelta(seconds=ORPHAN_AFTER_S)
    orphans = EngineBuild.objects.filter(
        host__name=settings.GANTRY_HOST_NAME, status__in=[B.RUNNING, B.CANCELLING], heartbeat_at__lt=cutoff
    )
    for build in orphans:
        pid = _process_of_build(build.runtime_handle, build.pk)
        if pid is not None:
            processes.terminate_group(pid)
        builds.build_finish(
            build_id=build.pk,
            to=B.FAILED,
            source=source(),
            message="the worker running this build stopped; what it left was stopped. Request the build again.",
            runtime_handle="",
        )
    for build in EngineBuild.objects.filter(host__name=settings.GANTRY_HOST_NAME, status=B.SUCCEEDED, files_missing=""):
        problem = engine_files_problem(build)
        if problem:
            builds.build_files_missing(build_id=build.pk, problem=problem, source=source())
    if not settings.GANTRY_BUILDER_IMAGES:
        return
    try:
        containers = docker_engine.build_containers(settings.GANTRY_HOST_NAME)
    except GantryError:
        return
    running = set(
        EngineBuild.objects.filter(pk__in=set(containers.values()), status__in=[B.RUNNING, B.CANCELLING]).values_list(
            "pk", flat=True
        )
    )
    for container_id, build_id in containers.items():
        if build_id not in running:
            log.info("removing container %s of build %s, which is not running", container_id[:12], build_id)
            docker_engine.remove_container(container_id)
