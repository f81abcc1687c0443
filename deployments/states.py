"""The deployment state machine: the one table of allowed status changes.

Services change a deployment's status only through ``transition`` in
deployments.services, which checks this table with a conditional update.
"""

from __future__ import annotations

from deployments.models import DeploymentStatus as S

ALLOWED: dict[str, frozenset[str]] = {
    S.PENDING: frozenset({S.LAUNCHING}),
    S.LAUNCHING: frozenset({S.LOADING, S.FAILED, S.STOPPING}),
    S.LOADING: frozenset({S.READY, S.FAILED, S.STOPPING}),
    S.READY: frozenset({S.DEGRADED, S.FAILED, S.STOPPING, S.UPDATING}),
    S.UPDATING: frozenset({S.READY, S.FAILED, S.STOPPING}),
    S.DEGRADED: frozenset({S.READY, S.FAILED, S.STOPPING}),
    S.STOPPING: frozenset({S.STOPPED, S.FAILED}),
    S.STOPPED: frozenset({S.LAUNCHING}),
    S.FAILED: frozenset({S.LAUNCHING, S.STOPPING}),
}

# States in which no server is running and none is being started: a launch or
# stop task that finds its deployment here has nothing left to do.
AT_REST = frozenset({S.PENDING, S.STOPPED, S.FAILED})
# States in which a server process may exist on the host.
ACTIVE = frozenset({S.LAUNCHING, S.LOADING, S.READY, S.UPDATING, S.DEGRADED, S.STOPPING})


def sources_of(target: str) -> frozenset[str]:
    """Every status from which ``target`` may be reached."""
    return frozenset(src for src, targets in ALLOWED.items() if target in targets)


def is_allowed(current: str, target: str) -> bool:
    return target in ALLOWED.get(current, frozenset())
