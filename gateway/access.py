"""Who calls the gateway and what their model name points at, read from the
database and kept a second per process, so a busy gateway does not read the
database per request: a revoked key, or a moved alias, takes effect within
that second. A key or alias in use (asked for again within a minute) is read
ahead in the background, so the first request after a quiet spell does not
wait on the database either."""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from django.db import InterfaceError, OperationalError, connection
from django.utils import timezone

from access.services import TOKEN_PREFIX
from common.ttl_cache import DatabaseAway, TtlCache
from common.words import a
from core.permissions import can_operate
from core.secrets import secret_digest
from deployments.models import DeploymentModel, ModelKind
from gateway.errors import GatewayError, model_not_found, not_ready
from gateway.models import Alias, ApiKey
from gateway.services import KEY_PREFIX
from inference.balancing import Endpoint, answering
from inference.generation import Route, route_of

CACHE_S = 1.0
KEEP_WARM_S = 60.0


@dataclass(frozen=True)
class Caller:
    key_id: int
    all_aliases: bool
    aliases: frozenset[str]
    expires_at: dt.datetime | None
    requests_per_minute: int | None
    tokens_per_minute: int | None

    def may_use(self, alias: str) -> bool:
        return self.all_aliases or alias in self.aliases


@dataclass(frozen=True)
class Target:
    """Where an alias's requests go now."""

    alias: str
    kind: str
    deployment: str
    status: str
    endpoints: list[Endpoint]  # the deployment's answering replicas (inference.balancing)
    triton_name: str
    max_batch_size: int
    route: Route | None  # an llm's generation route
    dimension: int | None = None  # an embedder's vectors' width, when its configuration says
    matryoshka: bool = False  # an embedder whose vectors may be cut short (OpenAI's dimensions)

    def require_ready(self) -> None:
        if not self.endpoints:
            raise not_ready(self.alias, f"deployment {self.deployment} is {self.status}: no replica is ready")


_callers, _targets = TtlCache(CACHE_S, keep_warm_s=KEEP_WARM_S), TtlCache(CACHE_S, keep_warm_s=KEEP_WARM_S)
# The errors of a database that cannot be reached (restarting, say): keys and routes
# read before it went away keep serving, as they were read; anything else is a 503.
DATABASE_AWAY = (OperationalError, InterfaceError, DatabaseAway)


def db(fn: Any) -> Any:
    """``fn`` (database reads) as a coroutine, on one of the gateway's reader threads.

    They are threads of their own, not the one thread Django's thread-sensitive
    calls share: a key's read must not wait behind the usage counts' write (a
    second's worth, waiting on the database's lock). Each keeps its connection
    from one read to the next (opening one per read, SQLite's file and its WAL
    pragma, cost more than the read) unless it broke; with a pool (PostgreSQL in
    the web server) a read borrows one and gives it back, as the pages do."""

    def run(*args: Any, **kwargs: Any) -> Any:
        _drop_if_broken()
        try:
            return fn(*args, **kwargs)
        finally:
            _release()

    async def call(*args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(_READERS, functools.partial(run, *args, **kwargs))

    return call


READER_THREADS = 4
_READERS = ThreadPoolExecutor(max_workers=READER_THREADS, thread_name_prefix="gateway-read")


def _drop_if_broken() -> None:
    """Close this thread's connection if a read failed on it and it no longer answers
    (a restarted PostgreSQL): the next read opens a new one."""
    if connection.connection is not None and connection.errors_occurred and not connection.is_usable():
        connection.close()
    connection.errors_occurred = False


def _release() -> None:
    if connection.settings_dict.get("OPTIONS", {}).get("pool"):
        connection.close()  # back to the pool, which the pages share
    else:
        _drop_if_broken()


def _invalid_key(message: str) -> GatewayError:
    return GatewayError(401, message, code="invalid_api_key")


def _read_caller(digest: str) -> Caller | GatewayError:
    key = ApiKey.objects.select_related("owner").filter(digest=digest).first()
    if key is None:
        return _invalid_key(
            "Incorrect API key provided. Create one on Gantry's gateway page or with POST /api/gateway/keys/."
        )
    if key.revoked_at is not None:
        return _invalid_key(f"API key {key.prefix}… was revoked at {key.revoked_at:%Y-%m-%d %H:%M:%S} UTC.")
    if not key.owner.is_active:
        return _invalid_key(f"API key {key.prefix}… belongs to a deactivated user.")
    if not can_operate(key.owner):
        # A key is an operator's: it stops with its owner's role (within the cache's second).
        return _invalid_key(f"API key {key.prefix}… belongs to a user who is no longer an operator.")
    return Caller(
        key_id=key.pk,
        all_aliases=key.all_aliases,
        aliases=frozenset(key.aliases.values_list("name", flat=True)),
        expires_at=key.expires_at,
        requests_per_minute=key.requests_per_minute,
        tokens_per_minute=key.tokens_per_minute,
    )


async def authenticate(headers: list[tuple[bytes, bytes]]) -> Caller:
    """The caller of an ``Authorization: Bearer <key>`` header, or a 401."""
    header = next((value for name, value in headers if name == b"authorization"), b"")
    if not header.startswith(b"Bearer ") or not header[7:].strip():
        raise _invalid_key("Send your API key as 'Authorization: Bearer <key>'.")
    secret = header[7:].strip().decode("latin-1")
    if secret.startswith(TOKEN_PREFIX):
        raise _invalid_key(
            f"This is a REST API token ({TOKEN_PREFIX}…): /v1 takes gateway keys ({KEY_PREFIX}…). Create one on "
            "Gantry's gateway page or with POST /api/gateway/keys/."
        )
    digest = secret_digest(secret)
    found = await _callers.fetch(digest, lambda: db(_read_caller)(digest), DATABASE_AWAY)
    if isinstance(found, GatewayError):
        raise found
    if found.expires_at is not None and found.expires_at <= timezone.now():
        raise _invalid_key(f"This API key expired at {found.expires_at:%Y-%m-%d %H:%M:%S} UTC.")
    return found


def _read_target(alias: str) -> Target | None:
    row = Alias.objects.select_related("deployment").filter(name=alias).first()
    if row is None:
        return None
    deployment = row.deployment
    placement = (
        DeploymentModel.objects.select_related("deployment", "registered_model")
        .filter(deployment=deployment, triton_name=row.triton_name)
        .first()
    )
    if placement is None:
        return Target(
            alias=alias, kind="", deployment=deployment.name, status=f"no longer serving {row.triton_name!r}",
            endpoints=[], triton_name=row.triton_name, max_batch_size=1, route=None,
        )  # fmt: skip
    kind = placement.registered_model.kind
    route = route_of(placement) if kind == ModelKind.LLM else None
    return Target(
        alias=alias,
        kind=kind,
        deployment=deployment.name,
        status=deployment.status,
        endpoints=route.endpoints if route else answering(deployment.pk),
        triton_name=placement.triton_name,
        max_batch_size=placement.max_batch_size,
        route=route,
        dimension=placement.registered_model.sentence_config.get("dimension"),
        matryoshka=bool(placement.registered_model.sentence_config.get("matryoshka")),
    )


async def resolve(caller: Caller, alias: Any, kind: str, endpoint: str) -> Target:
    """What ``alias`` points at, if the caller may use it and it is a ``kind`` model."""
    if not isinstance(alias, str) or not alias:
        raise GatewayError(400, "model: required (a model name from GET /v1/models)", param="model")
    if not caller.may_use(alias):
        raise model_not_found(alias)
    target = await _targets.fetch(alias, lambda: db(_read_target)(alias), DATABASE_AWAY)
    if not target:
        raise model_not_found(alias)
    if target.kind and target.kind != kind:
        raise GatewayError(
            400,
            f"model {alias!r} is {a(target.kind)} model; {endpoint} needs {a(kind)} model",
            param="model",
            code="model_not_supported",
        )
    target.require_ready()
    return target


def visible_aliases(caller: Caller) -> list[dict[str, Any]]:
    """The aliases the caller may use, as /v1/models lists them."""
    rows = Alias.objects.order_by("name")
    if not caller.all_aliases:
        rows = rows.filter(name__in=caller.aliases)
    return [
        {"id": name, "object": "model", "created": int(created.timestamp()), "owned_by": "gantry"}
        for name, created in rows.values_list("name", "created_at")
    ]
