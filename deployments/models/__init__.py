"""Gantry's deployments: registered checkpoints and engine builds, deployments
with their model placements and replicas, and what replicas report, one
module each; every model is importable from here. Hosts are in hosts.models,
the event timeline in core.models.

Status fields are only ever changed through ``deployments.states`` and the
services; nothing here flips a status in ``save()`` or a signal.
"""

from deployments.models.checkpoints import (
    BuildExecutor,
    BuildLogLine,
    BuildStatus,
    CheckpointCopy,
    DownloadStatus,
    EngineBuild,
    Inspection,
    ModelDownload,
    ModelKind,
    RegisteredModel,
    hub_snapshot,
)
from deployments.models.serving import (
    AutoscaleMetric,
    Backend,
    DecodingMode,
    Deployment,
    DeploymentModel,
    DeploymentRevision,
    DeploymentStatus,
    DesiredState,
    Dtype,
    InstanceKind,
    PlacementPolicy,
    Replica,
    RevisionStatus,
    Runtime,
    SchedulerPolicy,
    TimeoutAction,
    new_admin_secret,
)
from deployments.models.timeline import LogLine, MetricSample

__all__ = [
    "AutoscaleMetric",
    "Backend",
    "BuildExecutor",
    "BuildLogLine",
    "BuildStatus",
    "CheckpointCopy",
    "DecodingMode",
    "Deployment",
    "DeploymentModel",
    "DeploymentRevision",
    "DeploymentStatus",
    "DesiredState",
    "DownloadStatus",
    "Dtype",
    "EngineBuild",
    "Inspection",
    "InstanceKind",
    "LogLine",
    "MetricSample",
    "ModelDownload",
    "ModelKind",
    "PlacementPolicy",
    "RegisteredModel",
    "Replica",
    "RevisionStatus",
    "Runtime",
    "SchedulerPolicy",
    "TimeoutAction",
    "hub_snapshot",
    "new_admin_secret",
]
