"""Where work for a GPU host travels: its two queues, and the name of every task
Gantry sends. Sending goes through hosts.outbox (this module imports no
models, so hosts.models can name a host's queue).

A host has a control queue (launch, stop, apply, inspect, forget: seconds to
minutes) and a jobs queue (engine builds, hub downloads, load tests and tuning runs: up to hours), each
consumed by its own Celery worker with its own slots (workers.hostworker), so
control work never waits behind a long job.
"""

from __future__ import annotations

# Task names: the worker registers them in workers.tasks under these names. Launch,
# stop and apply take a replica (deployments.models.Replica): one Triton on one host.
LAUNCH_REPLICA = "workers.tasks.launch_replica"
STOP_REPLICA = "workers.tasks.stop_replica"
APPLY_GENERATION = "workers.tasks.apply_generation"
INSPECT_MODEL = "workers.tasks.inspect_model"
RUN_BUILD = "workers.tasks.run_build"
# Download a hub model into the host's cache (deployments.models.ModelDownload).
RUN_DOWNLOAD = "workers.tasks.run_download"
# Remove a hub model from the host's cache.
REMOVE_COPY = "workers.tasks.remove_copy"
# Remove what a deleted deployment or build left on its host's disk.
FORGET_DEPLOYMENT = "workers.tasks.forget_deployment"
FORGET_BUILD = "workers.tasks.forget_build"
# Run a load test of a deployed model from its host (loadtests).
RUN_LOADTEST = "workers.tasks.run_loadtest"
# Search a deployment's settings under a mixed load, trial by trial (loadtests.tuning).
RUN_TUNING = "workers.tasks.run_tuning"
# The control plane's periodic work (its beat runs it on queue "control", see settings).
SWEEP_HOSTS = "deployments.tasks.sweep_hosts"
# Beat tasks expire within their interval, so a rename strands nothing queued.
SYNC_HOST_ACCESS = "hosts.tasks.sync_host_access"


# The long jobs: they travel on the host's jobs queue.
JOB_TASKS = frozenset({RUN_BUILD, RUN_DOWNLOAD, RUN_LOADTEST, RUN_TUNING})
_PREFIX = "gpu."
_JOBS_SUFFIX = ".jobs"


def host_queue(host_name: str) -> str:
    """The control queue of a GPU host (its control worker consumes it, and nothing else does)."""
    return f"{_PREFIX}{host_name}"


def jobs_queue(host_name: str) -> str:
    """The jobs queue of a GPU host (its jobs worker consumes it, and nothing else does)."""
    return f"{_PREFIX}{host_name}{_JOBS_SUFFIX}"


def queue_for(task_name: str, host_name: str) -> str:
    """The queue ``task_name`` travels on to ``host_name``."""
    return jobs_queue(host_name) if task_name in JOB_TASKS else host_queue(host_name)


def host_queues(host_name: str) -> tuple[str, str]:
    """Both queues of a GPU host."""
    return host_queue(host_name), jobs_queue(host_name)


# Kombu's Redis transport keeps a queue's priorities in keys named so (queue, separator, step).
_PRIORITY_SEPARATOR = "\x06\x16"
_PRIORITY_STEPS = (3, 6, 9)
# A host's other keys: its workers' unacknowledged messages, and its live stream.
_UNACKED = (".unacked", ".unacked_index", ".unacked_mutex")
_LIVE_SUFFIX = ".live"
# A host name may not end so: its keys would be another host's.
RESERVED_SUFFIXES = (_JOBS_SUFFIX, _LIVE_SUFFIX, *_UNACKED)


def unacked_options(host_name: str) -> dict[str, str]:
    """The broker transport options that keep a host's unacknowledged messages under its own keys."""
    key, index, mutex = (f"{_PREFIX}{host_name}{suffix}" for suffix in _UNACKED)
    return {"unacked_key": key, "unacked_index_key": index, "unacked_mutex_key": mutex}


def live_stream(host_name: str) -> str:
    """The Redis stream a host's live messages go to (deployments.live_relay checks and relays them)."""
    return f"{_PREFIX}{host_name}{_LIVE_SUFFIX}"


def host_keys(host_name: str) -> list[str]:
    """Every Redis key a host's workers touch, by exact name (its ACL user's keys)."""
    keys = []
    for queue in host_queues(host_name):
        keys += [queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}"]
        keys += [f"{queue}{_PRIORITY_SEPARATOR}{step}" for step in _PRIORITY_STEPS]
    return [*keys, *unacked_options(host_name).values(), live_stream(host_name)]


def host_of(queue: str) -> str:
    """The host a queue of ``host_queues`` belongs to."""
    return queue.removeprefix(_PREFIX).removesuffix(_JOBS_SUFFIX)
