"""Where work for a GPU host travels: its queue, and the name of every task
Gantry sends. Sending goes through deployments.outbox (this module imports no
models, so deployments.models can name a host's queue).
"""

from __future__ import annotations

# Task names: the worker registers them in workers.tasks under these names.
LAUNCH_DEPLOYMENT = "workers.tasks.launch_deployment"
STOP_DEPLOYMENT = "workers.tasks.stop_deployment"
APPLY_GENERATION = "workers.tasks.apply_generation"
INSPECT_MODEL = "workers.tasks.inspect_model"
RUN_BUILD = "workers.tasks.run_build"
# Remove what a deleted deployment or build left on its host's disk.
FORGET_DEPLOYMENT = "workers.tasks.forget_deployment"
FORGET_BUILD = "workers.tasks.forget_build"
# Run a load test of a deployed model from its host (loadtests).
RUN_LOADTEST = "workers.tasks.run_loadtest"
# The control plane's periodic work (its beat runs it on queue "control", see settings).
SWEEP_HOSTS = "deployments.tasks.sweep_hosts"


def host_queue(host_name: str) -> str:
    """The queue a GPU host's worker consumes (and nothing else does)."""
    return f"gpu.{host_name}"
