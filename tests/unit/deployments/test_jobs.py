"""One job state machine shape: builds and load tests are registered kinds,
and a move the kind's table refuses writes nothing."""

from __future__ import annotations

import pytest

from common.errors import InvalidTransition, NotFound
from core import jobs
from deployments import states
from deployments.models import BuildStatus, EngineBuild
from deployments.services import builds
from loadtests import services as loadtest_services
from tests import factories


def test_builds_and_load_tests_are_the_registered_job_kinds():
    assert jobs.KINDS["build"] is states.BUILD and jobs.KINDS["load test"] is loadtest_services.LOAD_TEST.job
    with pytest.raises(ValueError, match="registered twice"):
        jobs.register(jobs.JobKind(name="build", model=EngineBuild, allowed={}, terminal=frozenset(), after=print))


def test_a_move_the_table_refuses_writes_nothing(llama, operator):  # noqa: ANN001
    build, _ = builds.build_request(model="llama", host="h100-host", image=factories.IMAGE, spec={}, user=operator)
    with pytest.raises(InvalidTransition, match=f"build {build.pk} is pending; it cannot become succeeded"):
        jobs.job_transition(states.BUILD, job_id=build.pk, to=BuildStatus.SUCCEEDED, source="test")
    assert EngineBuild.objects.get(pk=build.pk).status == BuildStatus.PENDING
    with pytest.raises(NotFound, match="build 0 does not exist"):
        jobs.job_transition(states.BUILD, job_id=0, to=BuildStatus.RUNNING, source="test")
