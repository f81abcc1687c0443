"""A joined GPU host's own credentials, used as an attacker who owns the host
would use them (docs/security.md, the threat model): real PostgreSQL roles and
row-level policies, real Redis ACL users, the real live relay. Two hosts join;
host A serves one deployment and host B another, and A tries to reach past
its own work. Every refusal below is a rule of hosts.grants (or of
deployments.live_relay); each assertion fails when its rule goes (the run on
the code before node restriction is kept in docs/security.md)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import psycopg
import pytest
import redis
from channels.layers import get_channel_layer
from django.contrib.auth.models import User

from core import events, queues
from core.models import Event
from deployments import live_relay
from deployments.models import CheckpointCopy, Deployment, RegisteredModel, Replica
from gateway import services as gateway_services
from hosts import grants
from hosts.models import GpuHost
from hosts.services import host_join, hosts

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def admin(transactional_db) -> Iterator[User]:  # noqa: ANN001
    yield User.objects.create_superuser(username="trust-admin", password="admin-pass")
    # Roles and Redis users outlive the test's rows: remove this database's.
    for role in grants.database_roles_listed():
        grants.database_role_drop(role)
    grants.redis_users_ensure({})


def _join(admin: User, name: str) -> host_join.Joined:
    made = host_join.host_join_token_create(user=admin, host_name=name)
    return host_join.host_join(token=made.secret, name=name, address="10.0.0.7", gateway_url="http://cp:8000")


def _serving(name: str, host: GpuHost, port: int) -> Deployment:
    deployment = Deployment.objects.create(name=name, status="ready")
    ports = {"http_port": port, "grpc_port": port + 1, "metrics_port": port + 2}
    Replica.objects.create(deployment=deployment, serial=1, host=host, generation=1, status="ready", **ports)
    return deployment


def _refused(db: psycopg.Connection, statement: str, *params: object) -> None:
    """``statement`` is refused for lack of a grant, or touches no row (a row policy hides it)."""
    try:
        with db.transaction():
            changed = db.execute(statement, params).rowcount
    except psycopg.errors.InsufficientPrivilege:
        return
    assert changed == 0, f"the host's role did this: {statement}"


def test_a_joined_hosts_credentials_reach_only_its_own_work(admin: User, operator: User) -> None:
    a, b = _join(admin, "host-a"), _join(admin, "host-b")
    host_a, host_b = GpuHost.objects.get(name="host-a"), GpuHost.objects.get(name="host-b")
    own, other = _serving("own", host_a, 21000), _serving("other", host_b, 21010)
    key = gateway_services.key_create(name="production", user=operator, all_aliases=True)
    other_replica = Replica.objects.get(deployment=other)
    hosts.host_cordon(host_name="host-a", user=admin, reason="maintenance")
    model = RegisteredModel.objects.create(name="m", kind="embedding", path="/m", host=host_b, fingerprint="f" * 64)
    CheckpointCopy.objects.create(model=model, host=host_b, fingerprint="f" * 64)

    with psycopg.connect(a.database_url, autocommit=True) as db:
        # What its work needs still works: its host row, its replica, an event about its deployment.
        assert db.execute("UPDATE deployments_gpuhost SET driver_version = 'x' WHERE name = 'host-a'").rowcount == 1
        assert db.execute("UPDATE deployments_replica SET status = 'ready' WHERE deployment_id = %s",
                          [own.pk]).rowcount == 1  # fmt: skip
        db.execute("INSERT INTO deployments_event (created_at, kind, source, message, deployment_id, host_id, "
                   "from_status, to_status, data) VALUES (now(), 'x', 'worker:host-a', 'fine', %s, %s, '', '', "
                   "'{}')", [own.pk, host_a.pk])  # fmt: skip

        # Users, tokens, keys, sessions, the channel authority and other hosts' rows: refused.
        _refused(db, "UPDATE auth_user SET is_superuser = true")
        _refused(db, "SELECT password FROM auth_user")
        _refused(db, "INSERT INTO access_apitoken (name, prefix, digest, created_at, user_id) "
                     "VALUES ('t', 'gt-x', repeat('0', 64), now(), %s)", admin.pk)  # fmt: skip
        _refused(db, "SELECT digest FROM gateway_apikey WHERE id = %s", key.key.pk)
        _refused(db, "INSERT INTO deployments_channelauthority (certificate, revocation_list, revocation_number, "
                     "revocation_signed_at, created_at) VALUES ('x', 'y', 1, now(), now())")  # fmt: skip
        _refused(db, "UPDATE deployments_channelauthority SET certificate = certificate || 'mine'")
        _refused(db, "SELECT authority_key FROM deployments_channelsecrets")
        _refused(db, "UPDATE deployments_hostcredential SET revoked_at = NULL")
        _refused(db, "INSERT INTO deployments_hostjointoken (token_sha256, host_name, created_at, expires_at, "
                     "used_by_host) VALUES (repeat('1', 64), '', now(), now() + interval '1 day', '')")  # fmt: skip
        _refused(db, "UPDATE deployments_replica SET status = 'failed' WHERE id = %s", other_replica.pk)
        _refused(db, "UPDATE deployments_gpuhost SET address = '10.6.6.6' WHERE name = 'host-b'")
        # Where the files are: A records its own disk's copies, never another host's (a copy claimed
        # for B would send B replicas it cannot serve; one of B's removed would keep them from B).
        db.execute("INSERT INTO deployments_checkpointcopy (model_id, host_id, fingerprint, checked_at) VALUES "
                   "(%s, %s, %s, now())", [model.pk, host_a.pk, "f" * 64])  # fmt: skip
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
            db.execute("INSERT INTO deployments_checkpointcopy (model_id, host_id, fingerprint, checked_at) VALUES "
                       "(%s, %s, %s, now())", [model.pk, host_b.pk, "f" * 64])  # fmt: skip
        _refused(db, "DELETE FROM deployments_checkpointcopy WHERE host_id = %s", host_b.pk)
        # Its downloads: A starts and reports its own, never one for B (which B's relay token would then open).
        download = ("INSERT INTO deployments_modeldownload (model_id, host_id, status, status_message, commit, "
                    "files_total, files_done, bytes_total, bytes_done, rate_bps, created_at) VALUES "
                    "(%s, %s, 'pending', '', '', 0, 0, 0, 0, 0, now())")  # fmt: skip
        db.execute(download, [model.pk, host_a.pk])
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
            db.execute(download, [model.pk, host_b.pk])
        _refused(db, "UPDATE deployments_modeldownload SET status = 'failed' WHERE host_id = %s", host_b.pk)
        _refused(db, "UPDATE deployments_checkpointcopy SET fingerprint = 'x' WHERE host_id = %s", host_b.pk)
        # Its cordon (an admin's): read by placement, never lifted nor made by the host itself.
        assert db.execute("SELECT count(*) FROM hosts_cordon WHERE host_id = %s", [host_a.pk]).fetchone() == (1,)
        _refused(db, "DELETE FROM hosts_cordon")
        _refused(db, "INSERT INTO hosts_cordon (host_id, created_at, reason) VALUES (%s, now(), 'mine')", host_b.pk)
        _refused(db, "UPDATE deployments_deployment SET desired_state = 'stopped' WHERE id = %s", other.pk)
        # The timeline is append-only, and only about its own work.
        _refused(db, "DELETE FROM deployments_event")
        _refused(db, "UPDATE deployments_event SET message = 'nothing happened'")
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
            db.execute("INSERT INTO deployments_event (created_at, kind, source, message, deployment_id, from_status, "
                       "to_status, data) VALUES (now(), 'x', 'x', 'lies', %s, '', '', '{}')", [other.pk])  # fmt: skip
        # A task for another host's worker: never written by A.
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
            db.execute("INSERT INTO deployments_outboxmessage (task, queue, args, created_at, attempts, last_error) "
                       "VALUES ('workers.tasks.stop_replica', %s, %s, now(), 0, '')",
                       [queues.host_queue("host-b"), json.dumps([other_replica.pk])])  # fmt: skip
    assert User.objects.filter(is_superuser=True).count() == 1 and Event.objects.filter(message="lies").count() == 0
    assert Replica.objects.get(pk=other_replica.pk).status == "ready"

    client = redis.Redis.from_url(a.redis_url)
    try:
        client.lpush(queues.host_queue("host-a"), "m")  # its own queue
        assert client.rpop(queues.host_queue("host-a")) == b"m"
        for command in (
            ("LPUSH", queues.host_queue("host-b"), "forged"),  # another host's queue
            ("LRANGE", queues.jobs_queue("host-b"), 0, -1),
            ("HLEN", "unacked"),  # every worker's unacknowledged messages
            ("DEL", f"gantry:gateway:rate:{key.key.pk}:1"),  # a key's rate window, reset
            ("SET", events.seq_key(events.DASHBOARD_GROUP), 0),
            ("ZADD", "gantry:channels:group:dashboard", 1, "x"),  # the channel layer's groups
            ("XADD", queues.live_stream("host-b"), "*", "m", "{}"),  # another host's live stream
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
    finally:
        client.close()

    # The live channel: a host's messages reach browsers only through the relay, which passes
    # on what is about its own work and drops the rest.
    layer = get_channel_layer()
    watcher = asyncio.run(layer.new_channel())
    for group in (events.deployment_group(own.pk), events.deployment_group(other.pk), events.DASHBOARD_GROUP):
        asyncio.run(layer.group_add(group, watcher))
    host_stream = redis.Redis.from_url(a.redis_url)
    control = redis.Redis.from_url(grants.settings.REDIS_URL)
    positions: dict[str, str] = {}
    try:
        live_relay.relay_once(control, positions)  # where each stream is now
        forged = {"type": "status", "deployment": other.pk, "status": "failed"}
        fair = {"type": "status", "deployment": own.pk, "status": "ready"}
        for groups, payload in (
            ([events.deployment_group(other.pk), events.DASHBOARD_GROUP], forged),  # not its deployment
            ([events.deployment_group(other.pk)], {**fair}),  # its payload, another deployment's page
            ([events.host_group("host-b")], {"type": "gpus", "host": "host-b", "gpus": []}),
            ([events.deployment_group(own.pk)], fair),
        ):
            message = json.dumps({"groups": groups, "payload": payload})
            host_stream.xadd(queues.live_stream("host-a"), {"m": message})
        assert live_relay.relay_once(control, positions) == 1
        events.publisher().flush()
        received = asyncio.run(asyncio.wait_for(layer.receive(watcher), 5))["payload"]
        assert received["deployment"] == own.pk and received["group"] == events.deployment_group(own.pk)
        with pytest.raises(TimeoutError):  # nothing else came
            asyncio.run(asyncio.wait_for(layer.receive(watcher), 1))
    finally:
        host_stream.close()
        control.close()
    del b
