"""Celery tasks run by the worker on each GPU host. Thin: they take ids and
call one function; the database row decides whether there is work to do."""

from __future__ import annotations

from celery import shared_task

from deployments import services
from workers import agent, builder, deployer  # noqa: F401 - importing agent connects it to worker start


@shared_task(name="workers.tasks.launch_deployment")
def launch_deployment(deployment_id: int) -> None:
    deployer.launch(deployment_id)


@shared_task(name="workers.tasks.stop_deployment")
def stop_deployment(deployment_id: int) -> None:
    deployer.stop(deployment_id)


@shared_task(name="workers.tasks.apply_generation")
def apply_generation(deployment_id: int, generation: int) -> None:
    deployer.apply_generation(deployment_id, generation)


@shared_task(name="workers.tasks.inspect_model")
def inspect_model(model_id: int) -> None:
    services.model_inspect(model_id=model_id, source=builder.source())


# A build enforces its own time limit (and may run for hours): no Celery limit.
@shared_task(name="workers.tasks.run_build", soft_time_limit=None, time_limit=None)
def run_build(build_id: int) -> None:
    builder.run_build(build_id)
