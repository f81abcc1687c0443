"""Gantry's domain: GPU hosts, registered checkpoints, engine builds,
deployments with their model placements, and the append-only event timeline,
one module each; every model is importable from here.

Status fields are only ever changed through ``deployments.states`` and the
services; nothing here flips a status in ``save()`` or a signal.
"""

from deployments.models.checkpoints import (
    BuildExecutor,
    BuildLogLine,
    BuildStatus,
    EngineBuild,
    Inspection,
    ModelKind,
    RegisteredModel,
)
from deployments.models.hosts import (
    ChannelAuthority,
    ChannelCertificate,
    ChannelSecrets,
    Gpu,
    GpuHost,
    HostCredential,
    HostJoinToken,
)
from deployments.models.serving import (
    GENERATIVE_BACKENDS,
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
from deployments.models.timeline import (
    Event,
    EventQuerySet,
    LogLine,
    MetricSample,
    OutboxMessage,
)
from deployments.models.validation import (
    DB_INT_MAX,
    slug_validator,
)

__all__ = [
    "AutoscaleMetric",
    "Backend",
    "BuildExecutor",
    "BuildLogLine",
    "BuildStatus",
    "ChannelAuthority",
    "ChannelCertificate",
    "ChannelSecrets",
    "DB_INT_MAX",
    "DecodingMode",
    "Deployment",
    "DeploymentModel",
    "DeploymentRevision",
    "DeploymentStatus",
    "DesiredState",
    "Dtype",
    "EngineBuild",
    "Event",
    "EventQuerySet",
    "GENERATIVE_BACKENDS",
    "Gpu",
    "GpuHost",
    "HostCredential",
    "HostJoinToken",
    "Inspection",
    "InstanceKind",
    "LogLine",
    "MetricSample",
    "ModelKind",
    "OutboxMessage",
    "PlacementPolicy",
    "RegisteredModel",
    "Replica",
    "RevisionStatus",
    "Runtime",
    "SchedulerPolicy",
    "TimeoutAction",
    "new_admin_secret",
    "slug_validator",
]
