"""What a joined GPU host may do in the control plane's PostgreSQL and Redis:
one database role and one Redis user per host, made, listed and removed here
and nowhere else. This is the node restriction of docs/security.md: a host
runs its users' model code, so its credentials must not reach past its own work.

PostgreSQL: every host role is a member of one group role. The group is
granted table by table (HOST_TABLES; a table not named there, like users,
tokens, gateway keys, sessions, join tokens, credentials and the channel
authority's key, gives it nothing), and row-level security keys each write on
the host the session's role belongs to (``gantry_host()``): a host updates
its own host row, replicas, builds, models, load tests and tuning runs, and
the deployments it serves; it appends events about those and never edits or
deletes one. The control plane's own role owns the tables, so these policies
never apply to it. Roles are cluster-wide, so their names carry the
database's name. Role statements are transactional: made inside the join's
transaction, a failed join leaves no role behind.

Redis: a host's ACL user may touch only its own keys (``redis_rules``): its
two queues, their bindings and unacknowledged-message keys, and its live
stream, which the control plane relays to browsers after checking it
(deployments.live_relay); it may read the live figures the web tier writes.
No channel-layer key, no other host's queue, no gateway counter. ACL users
live in Redis's memory: ``redis_users_ensure`` gives them again after a
restart, from the hashes the database keeps.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import redis
from django.conf import settings
from django.db import connection, transaction

from common.errors import PermanentError, TransientError
from core import queues

# The host the session's role belongs to, as every policy reads it: NULL for a
# role that is not a host's (the control plane's), 0 for a host role without
# an active credential (revoked: it may write nothing), else the host's id.
HOST = "(SELECT gantry_host())"
SERVED = f"(SELECT deployment_id FROM deployments_replica WHERE host_id = {HOST})"
OWN_BUILDS = f"(SELECT id FROM deployments_enginebuild WHERE host_id = {HOST})"
OWN_MODELS = f"(SELECT id FROM deployments_registeredmodel WHERE host_id = {HOST})"
# The models a host's work touches: those it registered, holds a copy of, downloads, builds or serves.
USED_MODELS = (
    f"(SELECT id FROM deployments_registeredmodel WHERE host_id = {HOST} UNION SELECT model_id FROM "
    f"deployments_checkpointcopy WHERE host_id = {HOST} UNION SELECT model_id FROM "
    f"deployments_modeldownload WHERE host_id = {HOST} UNION SELECT model_id FROM "
    f"deployments_enginebuild WHERE host_id = {HOST} UNION SELECT registered_model_id FROM "
    f"deployments_deploymentmodel WHERE deployment_id IN {SERVED})"
)
OWN_LOADTESTS = f"(SELECT id FROM loadtests_loadtest WHERE host_id = {HOST})"
OWN_TUNING_RUNS = f"(SELECT id FROM loadtests_tuningrun WHERE host_id = {HOST})"
# The queues of the hosts that serve a deployment this host serves (its own
# included): a roll it drives (a tuning trial) asks them for their part.
PEER_QUEUES = (
    "(SELECT q FROM deployments_gpuhost g, LATERAL (VALUES ('gpu.' || g.name), ('gpu.' || g.name || '.jobs')) v(q) "
    f"WHERE g.id IN (SELECT host_id FROM deployments_replica WHERE deployment_id IN {SERVED}) OR g.id = {HOST})"
)
EVENT_ABOUT_OWN_WORK = (
    f"actor_id IS NULL AND (host_id IS NULL OR host_id = {HOST}) AND (deployment_id IS NULL OR deployment_id IN "
    f"{SERVED}) AND (build_id IS NULL OR build_id IN {OWN_BUILDS}) AND (model_id IS NULL OR model_id IN {USED_MODELS})"
)

# What a host's role may do, table by table: the privileges, and for each
# write privilege the rows it may write (a row-level policy). Reads are of the
# fleet's configuration, none of it secret; an outbox row (its task's
# arguments) is read only by the hosts it is for.
HOST_TABLES: dict[str, tuple[str, dict[str, str]]] = {
    "deployments_gpuhost": ("SELECT, UPDATE", {"UPDATE": f"id = {HOST}"}),
    "deployments_gpu": ("SELECT, INSERT, UPDATE, DELETE", {"ALL": f"host_id = {HOST}"}),
    # Read by placement, which a host's worker runs for a surge; only an admin cordons.
    "hosts_cordon": ("SELECT", {}),
    "deployments_channelauthority": ("SELECT", {}),
    "deployments_channelcertificate": ("SELECT", {}),
    "deployments_registeredmodel": ("SELECT, UPDATE", {"UPDATE": f"host_id = {HOST}"}),
    # Each host records only what its own disk holds (workers.deploy.copies); placement reads them all.
    "deployments_checkpointcopy": ("SELECT, INSERT, UPDATE, DELETE", {"ALL": f"host_id = {HOST}"}),
    "deployments_enginebuild": ("SELECT, UPDATE", {"UPDATE": f"host_id = {HOST}"}),
    # A host starts a download of its own when a replica placed there lacks a hub model.
    "deployments_modeldownload": (
        "SELECT, INSERT, UPDATE",
        {"INSERT": f"host_id = {HOST}", "UPDATE": f"host_id = {HOST}"},
    ),
    "deployments_buildlogline": ("SELECT, INSERT, DELETE", {"ALL": f"build_id IN {OWN_BUILDS}"}),
    "deployments_deployment": ("SELECT, UPDATE", {"UPDATE": f"id IN {SERVED}"}),
    "deployments_deployment_pinned_hosts": ("SELECT", {}),
    "deployments_replica": (
        "SELECT, INSERT, UPDATE, DELETE",
        {"INSERT": f"deployment_id IN {SERVED}", "UPDATE": f"host_id = {HOST}", "DELETE": f"host_id = {HOST}"},
    ),
    "deployments_deploymentmodel": ("SELECT, INSERT, UPDATE, DELETE", {"ALL": f"deployment_id IN {SERVED}"}),
    "deployments_deploymentrevision": ("SELECT, INSERT, UPDATE", {"ALL": f"deployment_id IN {SERVED}"}),
    # UPDATE: a replica's removal sets its samples' and lines' replica to NULL.
    "deployments_metricsample": ("SELECT, INSERT, UPDATE, DELETE", {"ALL": f"deployment_id IN {SERVED}"}),
    "deployments_logline": ("SELECT, INSERT, UPDATE, DELETE", {"ALL": f"deployment_id IN {SERVED}"}),
    "deployments_event": ("SELECT, INSERT", {"INSERT": EVENT_ABOUT_OWN_WORK}),
    "deployments_outboxmessage": ("SELECT, INSERT, UPDATE, DELETE", {"ALL": f"queue IN {PEER_QUEUES}"}),
    "gateway_alias": ("SELECT", {}),
    "loadtests_loadtest": ("SELECT, UPDATE", {"UPDATE": f"host_id = {HOST}"}),
    "loadtests_loadpoint": ("SELECT, INSERT, UPDATE, DELETE", {"ALL": f"run_id IN {OWN_LOADTESTS}"}),
    "loadtests_tuningrun": ("SELECT, UPDATE", {"UPDATE": f"host_id = {HOST}"}),
    "loadtests_tuningtrial": ("SELECT, INSERT, UPDATE, DELETE", {"ALL": f"run_id IN {OWN_TUNING_RUNS}"}),
}
# Tables a host never reads nor writes (every other table of the schema must be in HOST_TABLES).
WITHHELD_TABLES = frozenset({
    "django_admin_log", "django_content_type", "django_migrations", "django_session",
    "auth_permission", "auth_group", "auth_group_permissions", "auth_user", "auth_user_groups",
    "auth_user_user_permissions",
    "access_apitoken", "access_idempotentrequest", "access_signinfailures", "access_externalidentity",
    "deployments_channelsecrets", "deployments_hostjointoken", "deployments_hostcredential",
    "gateway_apikey", "gateway_apikey_aliases", "gateway_usage",
})  # fmt: skip
# Tables where a policy may read every row (the outbox's reads follow its writes).
_READ_ALL_EXCEPT = frozenset({"deployments_outboxmessage"})


def _database_name() -> str:
    return re.sub(r"[^a-z0-9_]", "_", str(connection.settings_dict["NAME"]).lower())


def _role_name(suffix: str) -> str:
    name = f"{_database_name()}_{suffix}"
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[:54]}_{digest}"


def group_role() -> str:
    """The group role every host role of this database belongs to."""
    return _role_name("gantry_hosts")


def host_role(host_name: str, serial: str) -> str:
    """A host's database role: this database, the host and a serial (a rejoin gets a new role)."""
    return _role_name(f"host_{re.sub(r'[^a-z0-9_]', '_', host_name)}_{serial}")


def host_redis_user(host_name: str, serial: str) -> str:
    return f"{redis_user_prefix()}{host_name}-{serial}"


def redis_user_prefix() -> str:
    """Every host user of this control plane's Redis starts so (one Redis may serve several)."""
    return f"gantry-{_database_name()}-host-"


def _require_postgresql() -> None:
    if connection.vendor != "postgresql":
        raise PermanentError(
            f"hosts join a control plane on PostgreSQL; this one uses {connection.vendor}, "
            "which other machines cannot reach (set DATABASE_URL to a PostgreSQL database)"
        )


def _execute(statement: Any) -> None:
    """Run a psycopg.sql statement, saying what PostgreSQL refused."""
    import psycopg

    try:
        with connection.cursor() as cursor:
            cursor.execute(statement.as_string(connection.connection))
    except Exception as exc:  # Django wraps psycopg's errors; the cause says what PostgreSQL refused
        cause = exc.__cause__ if isinstance(exc.__cause__, psycopg.Error) else exc
        if isinstance(cause, psycopg.errors.InsufficientPrivilege):
            raise PermanentError(
                f"the control plane's database user may not manage host access ({cause}): "
                "it must own Gantry's tables and have CREATEROLE (ALTER ROLE <user> CREATEROLE)"
            ) from exc
        raise


def _host_function() -> Any:
    """``gantry_host()``: the host the session's role belongs to (HOST says what it
    returns). Nothing a session may set is trusted (a custom setting would be the
    host's own to forge): role membership from the catalog's cache, then the
    credential by its unique role name."""
    from psycopg import sql

    return sql.SQL(
        "CREATE OR REPLACE FUNCTION gantry_host() RETURNS bigint LANGUAGE sql STABLE SECURITY DEFINER "
        "SET search_path = pg_catalog, public AS $$ SELECT CASE WHEN pg_has_role(session_user, {group}, 'MEMBER') "
        "THEN COALESCE((SELECT host_id FROM deployments_hostcredential WHERE database_role = session_user "
        "AND revoked_at IS NULL), 0) END $$"
    ).format(group=sql.Literal(group_role()))


def _policies(table: str, writes: dict[str, str]) -> list[Any]:
    """The statements that give ``table`` exactly the host policies ``writes`` names."""
    from psycopg import sql

    name = sql.Identifier(table)
    group = sql.Identifier(group_role())
    statements = [sql.SQL("ALTER TABLE {} ENABLE ROW LEVEL SECURITY").format(name)]
    if table not in _READ_ALL_EXCEPT:
        read = sql.SQL("CREATE POLICY gantry_host_read ON {} FOR SELECT TO {} USING (true)")
        statements.append(read.format(name, group))
    for command, rows in writes.items():
        allowed = sql.SQL(f"{HOST} IS NULL OR ({rows})")
        using = sql.SQL(" USING ({})").format(allowed) if command != "INSERT" else sql.SQL("")
        check = sql.SQL(" WITH CHECK ({})").format(allowed) if command != "DELETE" else sql.SQL("")
        policy = sql.Identifier(f"gantry_host_{command.lower()}")
        statements.append(
            sql.SQL("CREATE POLICY {} ON {} FOR {} TO {}").format(policy, name, sql.SQL(command), group) + using + check
        )
    return statements


def database_grants_ensure() -> None:
    """The group role exists and has exactly what HOST_TABLES gives it: privileges
    table by table, and the row-level policies of its writes. Run at every join
    and sync: in one transaction (a host never sees its grants half-made), and
    only when HOST_TABLES or a table changed since the last run (the role's
    comment keeps a fingerprint), so the tables are not locked every sync."""
    _require_postgresql()
    from psycopg import sql  # PostgreSQL only: a demo on SQLite may lack the driver

    group = group_role()
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT relname, oid FROM pg_class WHERE relname = ANY(%s) AND relkind = 'r' ORDER BY relname",
                [list(HOST_TABLES)],
            )
            tables = cursor.fetchall()
            cursor.execute("SELECT shobj_description(oid, 'pg_authid') FROM pg_roles WHERE rolname = %s", [group])
            found = cursor.fetchone()
        wanted = f"{group} {sorted(HOST_TABLES.items())} {_host_function().as_string(connection.connection)} {tables}"
        marker = "gantry host access " + hashlib.sha256(wanted.encode()).hexdigest()
        if found is not None and found[0] == marker:
            return
        statements = _grants(sql)
        if found is None:
            _execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(group)))
        for statement in statements:
            _execute(statement)
        _execute(sql.SQL("COMMENT ON ROLE {} IS {}").format(sql.Identifier(group), sql.Literal(marker)))


def _grants(sql: Any) -> list[Any]:
    """Every statement that gives the group role what HOST_TABLES says, from any earlier state."""
    group = sql.Identifier(group_role())
    database = sql.Identifier(connection.settings_dict["NAME"])
    with connection.cursor() as cursor:
        cursor.execute("SELECT tablename, policyname FROM pg_policies WHERE policyname LIKE 'gantry_host_%%'")
        old_policies = cursor.fetchall()
        cursor.execute("SELECT t, pg_get_serial_sequence(t, 'id') FROM unnest(%s::text[]) t", [list(HOST_TABLES)])
        sequences = dict(cursor.fetchall())
    statements = [
        sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(database, group),
        sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(group),
        sql.SQL("REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {}").format(group),
        sql.SQL("REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM {}").format(group),
        sql.SQL("ALTER DEFAULT PRIVILEGES IN SCHEMA public REVOKE ALL ON TABLES FROM {}").format(group),
        sql.SQL("ALTER DEFAULT PRIVILEGES IN SCHEMA public REVOKE ALL ON SEQUENCES FROM {}").format(group),
        _host_function(),
    ]
    for table, policy in old_policies:
        statements.append(sql.SQL("DROP POLICY {} ON {}").format(sql.Identifier(policy), sql.Identifier(table)))
    for table, (privileges, writes) in HOST_TABLES.items():
        statements.append(sql.SQL(f"GRANT {privileges} ON {{}} TO {{}}").format(sql.Identifier(table), group))
        if "INSERT" in privileges and sequences.get(table):
            statements.append(sql.SQL("GRANT USAGE ON SEQUENCE {} TO {}").format(sql.SQL(sequences[table]), group))
        if writes:
            statements += _policies(table, writes)
    return statements


def database_role_create(role: str, password: str) -> None:
    """A login role with ``password``, a member of the group role and nothing else."""
    database_grants_ensure()  # first: it refuses SQLite by name
    from psycopg import sql

    _execute(
        sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION PASSWORD {}").format(
            sql.Identifier(role), sql.Literal(password)
        )
    )
    _execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(group_role()), sql.Identifier(role)))


def database_role_drop(role: str) -> None:
    """End the role's sessions, then remove it (a role already gone is fine)."""
    _require_postgresql()
    from psycopg import sql

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", [role])
    _execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def database_roles_listed() -> list[str]:
    """The host roles of this database that exist now."""
    _require_postgresql()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT r.rolname FROM pg_roles r JOIN pg_auth_members m ON m.member = r.oid "
            "JOIN pg_roles g ON g.oid = m.roleid WHERE g.rolname = %s",
            [group_role()],
        )
        return [row[0] for row in cursor.fetchall()]


def _redis() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=3, socket_timeout=5, retry=None)


def _redis_call(what: str, *commands: tuple[str, ...]) -> list:
    client = _redis()
    try:
        return [client.execute_command(*command) for command in commands]
    except redis.ResponseError as exc:
        needs = "Redis 7 or later, with Gantry's user its admin"
        raise PermanentError(f"Redis refused to {what} ({exc}): this needs {needs}") from exc
    except (redis.RedisError, OSError) as exc:
        raise TransientError(f"Redis is unreachable: {exc}") from exc
    finally:
        client.close()


def redis_rules(host_name: str) -> list[str]:
    """A host user's ACL rules: its own keys only (exact names, so host "a" never
    matches host "a-b"), the commands Celery and a stream need, no pub/sub channel,
    no admin or dangerous command but INFO (the agent reads the broker's run id)."""
    own = [f"~{key}" for key in queues.host_keys(host_name)]
    return ["on", *own, "%R~gantry:figures:*", "resetchannels", "+@all", "-@admin", "-@dangerous", "+info"]


def _setuser(name: str, host_name: str, digest: str) -> tuple[str, ...]:
    return ("ACL", "SETUSER", name, "reset", f"#{digest}", *redis_rules(host_name))


def redis_user_set(name: str, host_name: str, digest: str) -> None:
    """The host user ``name`` exists with ``host_name``'s rules and this password SHA-256."""
    _redis_call("set an ACL user", _setuser(name, host_name, digest))


def redis_users_ensure(users: dict[str, tuple[str, str]]) -> None:
    """Exactly these host users (name -> (host name, password SHA-256)) exist for this
    control plane, with today's rules: each is given again (after a Redis restart or
    an upgrade), any other removed."""
    prefix = redis_user_prefix()
    (listed,) = _redis_call("list ACL users", ("ACL", "USERS"))
    stale = [n for n in (x.decode() if isinstance(x, bytes) else x for x in listed) if n.startswith(prefix)]
    commands = [_setuser(name, host_name, digest) for name, (host_name, digest) in users.items()]
    commands += [("ACL", "DELUSER", name) for name in stale if name not in users]
    if commands:
        _redis_call("set ACL users", *commands)


def redis_user_remove(name: str) -> None:
    """Remove one host user; Redis closes its connections (one already gone is fine)."""
    _redis_call("remove an ACL user", ("ACL", "DELUSER", name))
