"""Joining GPU hosts against the real PostgreSQL and Redis: a one-time token buys
a database role and a Redis user of the host's own, which may do a worker's
work and nothing more, and stop working when revoked."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
import redis
from django.contrib.auth.models import User
from django.utils import timezone

from common.errors import PermissionDenied, ValidationFailed
from core.models import Event
from hosts import grants
from hosts.models import GpuHost, HostCredential, HostJoinToken
from hosts.services import host_join


@pytest.fixture
def admin(db) -> User:  # noqa: ANN001
    return User.objects.create_superuser(username="root-admin", password="admin-pass")


@pytest.fixture
def no_host_access_left(transactional_db) -> Iterator[None]:  # noqa: ANN001
    """Roles and Redis users outlive the test's rows: remove this database's."""
    yield
    for role in grants.database_roles_listed():
        grants.database_role_drop(role)
    grants.redis_users_ensure({})


def _join(admin: User, name: str = "gpu-07", **token: object) -> host_join.Joined:
    made = host_join.host_join_token_create(user=admin, **token)
    return host_join.host_join(token=made.secret, name=name, address="10.0.0.7", gateway_url="http://cp:8000")


def test_only_an_admin_makes_join_tokens_and_only_the_hash_is_kept(admin: User, operator: User) -> None:
    with pytest.raises(PermissionDenied, match="admin role"):
        host_join.host_join_token_create(user=operator)
    made = host_join.host_join_token_create(user=admin, host_name="gpu-07", minutes=5)
    assert made.secret.startswith("gj-")
    row = HostJoinToken.objects.get()
    assert made.secret not in row.token_sha256 and len(row.token_sha256) == 64
    assert timedelta(minutes=4) < row.expires_at - timezone.now() <= timedelta(minutes=5)
    with pytest.raises(ValidationFailed, match="expires_in_minutes"):
        host_join.host_join_token_create(user=admin, minutes=0)
    with pytest.raises(ValidationFailed, match="host: 'GPU 7' is not a host name"):
        host_join.host_join_token_create(user=admin, host_name="GPU 7")


def test_a_token_is_refused_used_expired_for_another_host_or_unknown(admin: User, no_host_access_left: None) -> None:
    joined = _join(admin, host_name="gpu-07")
    assert joined.host.name == "gpu-07" and joined.host.address == "10.0.0.7"
    assert HostJoinToken.objects.get().used_by_host == "gpu-07"
    secret = host_join.host_join_token_create(user=admin).secret
    host_join.host_join(token=secret, name="gpu-08", address="", gateway_url="")
    with pytest.raises(PermissionDenied, match="already used, by host gpu-08"):
        host_join.host_join(token=secret, name="gpu-08", address="", gateway_url="")
    expired = host_join.host_join_token_create(user=admin)
    HostJoinToken.objects.filter(pk=expired.row.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    with pytest.raises(PermissionDenied, match="expired at"):
        host_join.host_join(token=expired.secret, name="gpu-09", address="", gateway_url="")
    pinned = host_join.host_join_token_create(user=admin, host_name="gpu-10")
    with pytest.raises(PermissionDenied, match="it is for host gpu-10, not gpu-11"):
        host_join.host_join(token=pinned.secret, name="gpu-11", address="", gateway_url="")
    with pytest.raises(PermissionDenied, match="not a join token"):
        host_join.host_join(token="gj-made-up", name="gpu-12", address="", gateway_url="")
    with pytest.raises(ValidationFailed, match="reserved"):
        host_join.host_join(token=pinned.secret, name="join", address="", gateway_url="")
    # Refusals wrote nothing: the pinned token is still unused, and no host was made for it.
    assert HostJoinToken.objects.get(pk=pinned.row.pk).used_at is None
    assert not GpuHost.objects.filter(name__in=["gpu-09", "gpu-11", "gpu-12", "join"]).exists()


def test_a_joined_host_may_use_its_rows_but_not_change_the_schema_or_read_sessions(
    admin: User, no_host_access_left: None
) -> None:
    joined = _join(admin)
    credential = HostCredential.objects.get(host__name="gpu-07")
    assert joined.database_url.startswith(f"postgres://{credential.database_role}:")
    assert joined.settings["GANTRY_GATEWAY_URL"] == "http://cp:8000"
    assert Event.objects.filter(kind="host.joined", host__name="gpu-07").exists()
    with psycopg.connect(joined.database_url, autocommit=True) as db:
        assert db.execute("SELECT current_user").fetchone()[0] == credential.database_role
        db.execute("UPDATE deployments_gpuhost SET driver_version = 'x' WHERE name = 'gpu-07'")
        assert db.execute("SELECT count(*) FROM deployments_gpuhost").fetchone()[0] >= 1
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            db.execute("CREATE TABLE gantry_host_was_here (id int)")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            db.execute("SELECT * FROM django_session")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            db.execute("DROP TABLE deployments_event")
    client = redis.Redis.from_url(joined.redis_url)
    try:
        client.lpush("gpu.gpu-07", "m")  # its own queue
        assert client.brpop(["gpu.gpu-07"], timeout=1) == (b"gpu.gpu-07", b"m")
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.lpush("gpu.gpu-070", "m")  # a host whose name starts with its own is another host
        assert client.info("server")["run_id"]
        for command in (("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("ACL", "LIST")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
    finally:
        client.close()


def test_revoking_closes_the_hosts_sessions_and_its_credentials_stop_working(
    admin: User, operator: User, no_host_access_left: None
) -> None:
    joined = _join(admin)
    open_session = psycopg.connect(joined.database_url, autocommit=True)
    open_redis = redis.Redis.from_url(joined.redis_url)
    open_redis.ping()
    with pytest.raises(PermissionDenied):
        host_join.host_credentials_revoke(user=operator, host_name="gpu-07")
    assert host_join.host_credentials_revoke(user=admin, host_name="gpu-07") == 1
    with pytest.raises(psycopg.OperationalError):
        open_session.execute("SELECT 1")
    with pytest.raises(psycopg.OperationalError, match="does not exist|authentication failed"):
        psycopg.connect(joined.database_url)
    with pytest.raises(redis.exceptions.ConnectionError):
        open_redis.ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(joined.redis_url).ping()
    assert HostCredential.objects.get().revoked_at is not None
    assert GpuHost.objects.filter(name="gpu-07").exists()  # its row and timeline stay
    assert Event.objects.filter(kind="host.revoked", host__name="gpu-07").exists()
    # A new token brings it back, with new credentials.
    again = _join(admin)
    assert again.database_url != joined.database_url
    assert HostCredential.objects.filter(revoked_at=None).count() == 1


def test_the_sync_gives_back_what_a_redis_restart_lost_and_removes_what_is_revoked(
    admin: User, no_host_access_left: None
) -> None:
    joined = _join(admin)
    credential = HostCredential.objects.get()
    control = redis.Redis.from_url(grants.settings.REDIS_URL)
    try:
        control.execute_command("ACL", "DELUSER", credential.redis_user)  # as a restart without an ACL file
        stray = f"{grants.redis_user_prefix()}ghost-1"
        control.execute_command("ACL", "SETUSER", stray, "on", ">x", "+@all")  # left by a join that did not commit
        assert host_join.host_access_sync() == 1
        users = {u.decode() for u in control.execute_command("ACL", "USERS")}
        assert credential.redis_user in users and stray not in users
    finally:
        control.close()
    assert redis.Redis.from_url(joined.redis_url).ping()
    # A role whose credential is revoked in the database alone (a crash mid-revoke) is dropped.
    HostCredential.objects.filter(pk=credential.pk).update(revoked_at=timezone.now())
    assert host_join.host_access_sync() == 0
    assert credential.database_role not in grants.database_roles_listed()


def test_join_tokens_and_revoking_through_the_api(admin: User, operator: User, no_host_access_left: None) -> None:
    from rest_framework.test import APIClient

    as_admin, as_operator, anonymous = APIClient(), APIClient(), APIClient()
    as_admin.force_authenticate(admin)
    as_operator.force_authenticate(operator)
    assert as_operator.post("/api/hosts/join-tokens/", {}, format="json").status_code == 403
    made = as_admin.post("/api/hosts/join-tokens/", {"host": "gpu-07", "expires_in_minutes": 10}, format="json")
    assert made.status_code == 201, made.json()
    body = made.json()
    assert body["command"] == f"gantry join http://testserver {body['token']} --name gpu-07"
    bad = anonymous.post("/api/hosts/join/", {"token": body["token"], "name": "gpu-07", "port": 1}, format="json")
    assert bad.status_code == 400 and bad.json()["errors"] == {"port": ["is not a known field"]}
    joined = anonymous.post("/api/hosts/join/", {"token": body["token"], "name": "gpu-07"}, format="json")
    assert joined.status_code == 201, joined.json()
    assert joined.json()["host"] == "gpu-07" and joined.json()["redis_url"].startswith("redis://gantry-")
    again = anonymous.post("/api/hosts/join/", {"token": body["token"], "name": "gpu-07"}, format="json")
    assert again.status_code == 403 and "already used" in again.json()["detail"]
    assert as_operator.post("/api/hosts/gpu-07/revoke/").status_code == 403
    revoked = as_admin.post("/api/hosts/gpu-07/revoke/")
    assert revoked.status_code == 200 and revoked.json() == {"revoked": 1}
    assert as_admin.post("/api/hosts/nowhere/revoke/").status_code == 404


def test_every_table_is_either_given_to_hosts_or_withheld_from_them() -> None:
    """A new table gives hosts nothing until it is classified here (hosts.grants)."""
    from django.apps import apps

    tables = {m._meta.db_table for m in apps.get_models(include_auto_created=True)}
    tables.add("django_migrations")
    assert not set(grants.HOST_TABLES) & grants.WITHHELD_TABLES
    assert tables == set(grants.HOST_TABLES) | grants.WITHHELD_TABLES


def test_a_host_name_whose_queues_would_be_another_hosts_is_refused(admin: User) -> None:
    for name in ("gpu-07.jobs", "gpu-07.live", "gpu-07.unacked"):
        with pytest.raises(ValidationFailed, match="its queues would be another host's"):
            host_join.host_join_token_create(user=admin, host_name=name)
