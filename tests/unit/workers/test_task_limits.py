"""The tasks that bound themselves run under Celery limits far beyond the
worker's default: Celery reads a task's None as that default (billiard's
``soft_timeout or self.soft_timeout``), which cut a tuning run at its fifth
minute in CI."""

from __future__ import annotations

from django.conf import settings

from workers import tasks


def test_self_bounded_tasks_outlast_the_workers_default_limit():
    for task in (tasks.run_build, tasks.run_download, tasks.run_loadtest, tasks.run_tuning):
        assert task.soft_time_limit is not None and task.time_limit is not None, task.name
        assert task.soft_time_limit >= 24 * 3600 > settings.CELERY_TASK_SOFT_TIME_LIMIT, task.name
        assert task.time_limit > task.soft_time_limit, task.name
        assert task.soft_time_limit >= settings.GANTRY_BUILD_TIME_LIMIT_MAX, task.name


def test_other_tasks_keep_the_workers_default():
    assert tasks.apply_generation.soft_time_limit is None  # CELERY_TASK_SOFT_TIME_LIMIT applies
