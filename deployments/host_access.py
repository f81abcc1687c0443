"""What a joined GPU host may do in the control plane's PostgreSQL and Redis:
one database role and one Redis ACL user per host, made, listed and removed here
and nowhere else.

PostgreSQL: every host role is a member of one group role that may read and
write rows of Gantry's tables (not sessions) and nothing more: no DDL, no
other database, no superuser. Roles are cluster-wide, so their names carry the
database's name. Role statements are transactional: made inside the join's
transaction, a failed join leaves no role behind.

Redis: a host's ACL user may run everything Celery and the channel layer use,
not the admin or dangerous commands (FLUSHALL, CONFIG, KEYS, ...) but INFO,
which the host agent reads the broker's run id from. ACL users live in
Redis's memory: ``redis_users_ensure`` gives them again after a restart, from
the hashes the database keeps.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import redis
from django.conf import settings
from django.db import connection

from common.errors import PermanentError, TransientError

REDIS_RULES = ["on", "~*", "&*", "+@all", "-@admin", "-@dangerous", "+info"]
# Tables a host never reads: signed-in users' sessions, and the channel authority's key.
WITHHELD_TABLES = ["django_session", "deployments_channelsecrets"]


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
                f"the control plane's database user may not manage roles ({cause}): "
                "give it CREATEROLE (ALTER ROLE <user> CREATEROLE)"
            ) from exc
        raise


def database_grants_ensure() -> None:
    """The group role exists and may use every table of Gantry's schema but the
    withheld ones, now and for tables later migrations make."""
    _require_postgresql()
    from psycopg import sql  # PostgreSQL only: a demo on SQLite may lack the driver

    group = sql.Identifier(group_role())
    database = sql.Identifier(connection.settings_dict["NAME"])
    rows, sequences = "SELECT, INSERT, UPDATE, DELETE", "USAGE, SELECT"
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [group_role()])
        exists = cursor.fetchone() is not None
    if not exists:
        _execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(group))
    _execute(sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(database, group))
    _execute(sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(group))
    _execute(sql.SQL(f"GRANT {rows} ON ALL TABLES IN SCHEMA public TO {{}}").format(group))
    _execute(sql.SQL(f"GRANT {sequences} ON ALL SEQUENCES IN SCHEMA public TO {{}}").format(group))
    _execute(sql.SQL(f"ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT {rows} ON TABLES TO {{}}").format(group))
    _execute(sql.SQL(f"ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT {sequences} ON SEQUENCES TO {{}}").format(group))
    for table in WITHHELD_TABLES:
        _execute(sql.SQL("REVOKE ALL ON {} FROM {}").format(sql.Identifier(table), group))


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
        needs = "Redis 6 or later, with Gantry's user its admin"
        raise PermanentError(f"Redis refused to {what} ({exc}): this needs {needs}") from exc
    except (redis.RedisError, OSError) as exc:
        raise TransientError(f"Redis is unreachable: {exc}") from exc
    finally:
        client.close()


def _setuser(name: str, digest: str) -> tuple[str, ...]:
    return ("ACL", "SETUSER", name, "reset", f"#{digest}", *REDIS_RULES)


def redis_user_set(name: str, digest: str) -> None:
    """The host user ``name`` exists with the host rules and this password SHA-256."""
    _redis_call("set an ACL user", _setuser(name, digest))


def redis_users_ensure(users: dict[str, str]) -> None:
    """Exactly these host users (name -> password SHA-256) exist for this control
    plane: each is given again (after a Redis restart), any other removed."""
    prefix = redis_user_prefix()
    (listed,) = _redis_call("list ACL users", ("ACL", "USERS"))
    stale = [n for n in (x.decode() if isinstance(x, bytes) else x for x in listed) if n.startswith(prefix)]
    commands = [_setuser(name, digest) for name, digest in users.items()]
    commands += [("ACL", "DELUSER", name) for name in stale if name not in users]
    if commands:
        _redis_call("set ACL users", *commands)


def redis_user_remove(name: str) -> None:
    """Remove one host user; Redis closes its connections (one already gone is fine)."""
    _redis_call("remove an ACL user", ("ACL", "DELUSER", name))
