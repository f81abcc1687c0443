"""Writes of the gateway: aliases, keys and usage. Every alias change is on
the timeline of the deployments it touches."""

from __future__ import annotations

import datetime as dt
import secrets
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from common.errors import NotFound, ValidationFailed
from common.words import a
from core.events import record, source_of
from core.permissions import require_operator
from core.secrets import secret_digest
from deployments.models import Deployment, DeploymentModel
from gateway.models import Alias, ApiKey, Usage

KEY_PREFIX = "gk-"


def _placement(deployment_id: Any, triton_name: str) -> tuple[Deployment, DeploymentModel]:
    deployment = Deployment.objects.filter(pk=deployment_id).first() if str(deployment_id).isdigit() else None
    if deployment is None:
        raise ValidationFailed({"deployment": f"deployment {deployment_id} does not exist"})
    placement = deployment.placements.select_related("registered_model").filter(triton_name=triton_name).first()
    if placement is None:
        names = ", ".join(deployment.placements.values_list("triton_name", flat=True)) or "none"
        raise ValidationFailed(
            {"model": f"{deployment.name} serves no model named {triton_name!r} (it serves: {names})"}
        )
    return deployment, placement


def alias_create(*, name: str, deployment_id: int, triton_name: str, user: Any = None) -> Alias:
    """Point a new gateway model name at a deployment's model."""
    require_operator(user)
    with transaction.atomic():
        deployment, placement = _placement(deployment_id, triton_name)
        if Alias.objects.filter(name=name).exists():
            raise ValidationFailed({"name": f"alias {name!r} exists; move it instead"})
        alias = Alias.objects.create(
            name=name, deployment=deployment, triton_name=triton_name, created_by=user if user else None
        )
        record(
            kind="alias.created",
            source=source_of(user),
            actor=user,
            deployment=deployment,
            message=f"gateway model {name!r} now serves {deployment.name}/{triton_name} "
            f"({placement.registered_model.kind})",
            data={"alias": name, "triton_name": triton_name},
        )
    return alias


def alias_move(*, alias_id: int, deployment_id: int, triton_name: str, user: Any = None) -> Alias:
    """Point an alias at another model, in one update: a request resolves the alias
    before or after the move, never half-way. On both deployments' timelines."""
    require_operator(user)
    with transaction.atomic():
        alias = Alias.objects.select_for_update().select_related("deployment").filter(pk=alias_id).first()
        if alias is None:
            raise NotFound(f"alias {alias_id} does not exist")
        deployment, placement = _placement(deployment_id, triton_name)
        before, before_name = alias.deployment, alias.triton_name
        if before.pk == deployment.pk and before_name == triton_name:
            return alias
        old_kind = (
            DeploymentModel.objects.filter(deployment=before, triton_name=before_name)
            .values_list("registered_model__kind", flat=True)
            .first()
        )
        if old_kind is not None and old_kind != placement.registered_model.kind:
            raise ValidationFailed(
                {"model": f"{alias.name!r} serves a {old_kind} model; {deployment.name}/{triton_name} "
                 f"is {a(placement.registered_model.kind)} (clients would break)"}
            )  # fmt: skip
        alias.deployment, alias.triton_name = deployment, triton_name
        alias.save(update_fields=["deployment", "triton_name", "updated_at"])
        message = (
            f"gateway model {alias.name!r} moved from {before.name}/{before_name} to {deployment.name}/{triton_name}"
        )
        data = {"alias": alias.name, "from": f"{before.name}/{before_name}", "to": f"{deployment.name}/{triton_name}"}
        for touched in {before.pk: before, deployment.pk: deployment}.values():
            record(
                kind="alias.moved", source=source_of(user), actor=user, deployment=touched, message=message, data=data
            )
    return alias


def alias_delete(*, alias_id: int, user: Any = None) -> None:
    require_operator(user)
    with transaction.atomic():
        alias = Alias.objects.select_for_update().select_related("deployment").filter(pk=alias_id).first()
        if alias is None:
            raise NotFound(f"alias {alias_id} does not exist")
        record(
            kind="alias.deleted",
            source=source_of(user),
            actor=user,
            deployment=alias.deployment,
            message=f"gateway model {alias.name!r} deleted (it served {alias.deployment.name}/{alias.triton_name})",
            data={"alias": alias.name},
        )
        alias.delete()


@dataclass(frozen=True)
class NewKey:
    key: ApiKey
    secret: str  # shown once, never stored


def key_create(
    *,
    name: str,
    user: Any,
    all_aliases: bool = False,
    alias_names: list[str] | None = None,
    expires_at: dt.datetime | None = None,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
) -> NewKey:
    """A new key for ``user``, scoped to all aliases or the named ones."""
    require_operator(user)
    alias_names = list(alias_names or [])
    if all_aliases == bool(alias_names):
        raise ValidationFailed({"aliases": "name the aliases this key may use, or set all_aliases (not both)"})
    aliases = list(Alias.objects.filter(name__in=alias_names))
    missing = sorted(set(alias_names) - {alias.name for alias in aliases})
    if missing:
        raise ValidationFailed({"aliases": f"no such alias: {', '.join(missing)}"})
    if expires_at is not None and expires_at <= timezone.now():
        raise ValidationFailed({"expires_at": "must be in the future"})
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    with transaction.atomic():
        key = ApiKey.objects.create(
            name=name,
            prefix=secret[:10],
            digest=secret_digest(secret),
            owner=user,
            all_aliases=all_aliases,
            expires_at=expires_at,
            requests_per_minute=requests_per_minute,
            tokens_per_minute=tokens_per_minute,
        )
        key.aliases.set(aliases)
    return NewKey(key=key, secret=secret)


def key_revoke(*, key_id: int, user: Any = None) -> ApiKey:
    """Stop a key from working (within the gateway's one-second cache); revoking twice is harmless."""
    require_operator(user)
    ApiKey.objects.filter(pk=key_id, revoked_at=None).update(revoked_at=timezone.now())
    key = ApiKey.objects.filter(pk=key_id).first()
    if key is None:
        raise NotFound(f"API key {key_id} does not exist")
    return key


@dataclass
class Tally:
    requests: int = 0
    failed: int = 0
    refused: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


def usage_add(*, counts: dict[tuple[int, str, dt.date], Tally], last_used: dict[int, dt.datetime]) -> None:
    """Add what the gateway counted since its last flush (one row per key, alias and day)."""
    for (key_id, alias, day), tally in counts.items():
        increments = {
            "requests": F("requests") + tally.requests,
            "failed": F("failed") + tally.failed,
            "refused": F("refused") + tally.refused,
            "prompt_tokens": F("prompt_tokens") + tally.prompt_tokens,
            "completion_tokens": F("completion_tokens") + tally.completion_tokens,
        }
        if Usage.objects.filter(key_id=key_id, alias=alias, day=day).update(**increments):
            continue
        try:
            with transaction.atomic():
                Usage.objects.create(key_id=key_id, alias=alias, day=day, **vars(tally))
        except IntegrityError:  # another process created the row meanwhile
            Usage.objects.filter(key_id=key_id, alias=alias, day=day).update(**increments)
    for key_id, at in last_used.items():
        ApiKey.objects.filter(pk=key_id).update(last_used_at=at)
