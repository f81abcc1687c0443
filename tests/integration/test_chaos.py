"""Outages for real: Redis (the broker and the channel layer) stopped and
started again under a running stack, the worker stopped while its queue is
lost, and a container deployment driven through a failed restart, a long load
and a Redis restart under a load test. After each, nothing is stranded, no
server is started twice, and the timeline says what happened."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from controlplane.celery import host_worker_argv
from controlplane.serving import pages_argv, web_argv
from core.models import Event
from deployments.models import Deployment, Replica
from hosts.models import GpuHost, OutboxMessage
from tests import factories
from tests.integration.conftest import (
    PostgresServer,
    RedisServer,
    Stack,
    _spawn,
    bootstrap,
    clean_up,
    free_port,
    free_ports,
    healthz_answers,
    make_stack,
    stop_process,
    wait_for,
)
from workers.runtimes import process

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

# What a request used to wait on the pool for each read while PostgreSQL was away (the default).
POOL_TIMEOUT_S = 10


def _deploy(stack: Stack, minilm_path: Path, *, start: bool = True) -> int:
    http = stack.session()
    stack.register_models(minilm_path, minilm="embedding")
    created = http.post(
        f"{stack.web_url}/api/deployments/",
        json={"name": "chaos", "host": stack.host_name, "models": [{"model": "minilm"}]},
        timeout=30,
    )
    assert created.status_code == 201, created.text
    deployment_id = created.json()["id"]
    if start:
        assert http.post(f"{stack.web_url}/api/deployments/{deployment_id}/start/", timeout=30).status_code == 202
    return deployment_id


def _status(deployment_id: int) -> str:
    return Deployment.objects.get(pk=deployment_id).status


def _kinds(**where: object) -> set[str]:
    return set(Event.objects.filter(**where).values_list("kind", flat=True))


def test_a_stop_asked_while_redis_is_down_is_carried_out_once_it_is_back(
    stack_on_own_redis: Stack, own_redis: RedisServer, minilm_path: Path
):
    stack = stack_on_own_redis
    http = stack.session()
    deployment_id = _deploy(stack, minilm_path)
    wait_for(lambda: _status(deployment_id) == "ready", 240, "the deployment to be ready")
    server = factories.replica_row(deployment_id).runtime_handle

    own_redis.stop()
    stopped = http.post(f"{stack.web_url}/api/deployments/{deployment_id}/stop/", timeout=30)
    # Accepted and queued: JSON, the database says stopping, and the task waits in the outbox.
    assert stopped.status_code == 202, stopped.text
    assert stopped.json()["status"] == "stopping"
    wait_for(lambda: "task.waiting" in _kinds(deployment_id=deployment_id), 30, "the timeline to say the task waits")
    host = GpuHost.objects.get(name=stack.host_name)
    wait_for(lambda: "host.broker_unreachable" in _kinds(host=host), 30, "the agent to notice the outage")
    # The API and the pages keep answering from the database meanwhile.
    assert http.get(f"{stack.web_url}/api/deployments/{deployment_id}/", timeout=10).json()["status"] == "stopping"
    assert http.get(f"{stack.web_url}/api/deployments/{deployment_id}/events/", timeout=10).status_code == 200
    assert process.is_running(server, stack.data_dir / "deployments" / f"{deployment_id}-chaos" / "r1" / "repository")

    own_redis.start()  # empty: nothing the old one held survives
    wait_for(lambda: _status(deployment_id) == "stopped", 60, "the stop to be carried out")
    assert process.servers_under(stack.data_dir) == []
    timeline = list(Event.objects.filter(deployment_id=deployment_id).values_list("kind", "source", "message"))
    assert {"task.waiting", "task.redriven"} <= _kinds(deployment_id=deployment_id), "\n".join(map(str, timeline))
    assert "host.broker_back" in _kinds(host=host)
    late = Event.objects.get(deployment_id=deployment_id, kind="task.redriven")
    assert "after it was asked for" in late.message


def test_the_worker_outlives_a_redis_outage_in_the_middle_of_a_task(
    stack_on_own_redis: Stack, own_redis: RedisServer, minilm_path: Path
):
    """Redis goes away while the launch task runs (its message not yet acknowledged):
    the worker reconnects instead of exiting, and the launch ends ready. Celery
    5.7.0's worker exited here ("Unrecoverable error" while restoring the message);
    requirements.lock pins 5.6.3 for that reason."""
    stack = stack_on_own_redis
    deployment_id = _deploy(stack, minilm_path)
    wait_for(lambda: _status(deployment_id) == "loading", 60, "the launch task to start tritonserver")
    own_redis.stop()
    time.sleep(2)
    own_redis.start()
    wait_for(lambda: _status(deployment_id) == "ready", 240, "the launch to finish")
    # The worker still consumes: a stop reaches it through the restarted Redis.
    assert stack.worker.poll() is None, (stack.log_dir / "worker.log").read_text()[-3000:]
    stack.session().post(f"{stack.web_url}/api/deployments/{deployment_id}/stop/", timeout=30)
    wait_for(lambda: _status(deployment_id) == "stopped", 60, "the deployment to stop")
    assert stack.worker.poll() is None
    assert "Unrecoverable error" not in (stack.log_dir / "worker.log").read_text()


def _lose_with_redis(stack: Stack, own_redis: RedisServer, ask) -> None:  # noqa: ANN001
    """With no worker consuming, ``ask`` for something, let its task reach Redis, and
    restart Redis empty (the task is lost with it); then start the worker again."""
    stop_process(stack.worker)
    response = ask()
    assert response.status_code == 202, response.text
    wait_for(lambda: not OutboxMessage.objects.exists(), 10, "the task to be handed to Redis")
    own_redis.stop()
    own_redis.start()
    stack.start_worker()


def test_a_launch_and_an_update_lost_with_a_restarted_redis_are_sent_again(
    stack_on_own_redis: Stack, own_redis: RedisServer, minilm_path: Path
):
    stack = stack_on_own_redis
    deployment_id = _deploy(stack, minilm_path, start=False)
    wait_for(lambda: GpuHost.objects.get(name=stack.host_name).broker_run_id, 30, "the agent to see the broker")
    url = f"{stack.web_url}/api/deployments/{deployment_id}/"
    http = stack.session()
    _lose_with_redis(stack, own_redis, lambda: http.post(f"{url}start/", timeout=30))
    wait_for(lambda: _status(deployment_id) == "ready", 240, "the re-driven launch to finish")
    host = GpuHost.objects.get(name=stack.host_name)
    # The worker's start and the broker's new run id each re-drive what waits; whichever
    # comes first sends the launch (the other finds it still in the outbox, or sends a
    # harmless duplicate).
    redrives = list(Event.objects.filter(host=host, kind="host.redrive").values_list("message", flat=True))
    assert any("the broker restarted" in m for m in redrives), redrives
    assert any("deployment chaos" in m for m in redrives), redrives
    server = factories.replica_row(deployment_id).runtime_handle
    assert [h for h, _ in process.servers_under(stack.data_dir)] == [server]

    # A new generation (applied in place) lost the same way.
    change = {"models": [{"model": "minilm", "max_batch_size": 8}]}
    _lose_with_redis(stack, own_redis, lambda: http.put(f"{url}models/", json=change, timeout=30))
    wait_for(lambda: _status(deployment_id) == "ready", 240, "the re-driven update to finish")
    row = factories.replica_row(deployment_id)
    assert (row.generation, row.runtime_handle) == (2, server)  # applied in place, on the same server
    assert row.deployment.placements.get().max_batch_size == 8
    applied = Event.objects.filter(deployment=row.deployment, kind="deployment.generation_applied").get()
    assert "generation 2" in applied.message
    http.post(f"{url}stop/", timeout=30)
    wait_for(lambda: _status(deployment_id) == "stopped", 60, "the deployment to stop")


def test_a_killed_worker_leaves_its_server_serving_and_the_next_one_adopts_it(
    stack_on_own_redis: Stack, minilm_path: Path
):
    stack = stack_on_own_redis
    deployment_id = _deploy(stack, minilm_path)
    wait_for(lambda: _status(deployment_id) == "ready", 240, "the deployment to be ready")
    server = factories.replica_row(deployment_id).runtime_handle
    stack.worker.send_signal(signal.SIGKILL)
    stack.worker.wait()
    stack.start_worker()
    wait_for(lambda: "deployment.adopted" in _kinds(deployment_id=deployment_id), 60, "the adoption on the timeline")
    adopted = Event.objects.get(deployment_id=deployment_id, kind="deployment.adopted")
    assert server in adopted.message
    assert _status(deployment_id) == "ready"
    assert [h for h, _ in process.servers_under(stack.data_dir)] == [server]


def test_postgres_restarted_under_a_running_deployment_is_survived(
    own_postgres: PostgresServer, tmp_path: Path, minilm_path: Path
):
    """The whole stack on a PostgreSQL of the test's own, stopped and started again
    while a deployment serves: Triton keeps serving, the API says 503 meanwhile,
    the agent says it recovered, and the deployment still stops cleanly."""
    host = "pg-chaos"
    data_dir = tmp_path / "data"
    triton = free_ports(30)
    env = {
        **os.environ,
        "DATABASE_URL": own_postgres.url,
        "GANTRY_HOST_NAME": host,
        "GANTRY_DATA_DIR": str(data_dir),
        "GANTRY_HEARTBEAT_INTERVAL": "1",
        "GANTRY_TRITON_PORT_RANGE": f"{triton}-{triton + 29}",
        "PYTHONUNBUFFERED": "1",
    }
    token = bootstrap(env)
    web_port = free_port()
    logs = tmp_path / "logs"
    logs.mkdir()
    web = _spawn(web_argv(sys.executable, bind="127.0.0.1", port=web_port, workers=1), env, logs / "web.log")
    pages_port = free_port()
    pages = _spawn(pages_argv(sys.executable, bind="127.0.0.1", port=pages_port, workers=1), env, logs / "pages.log")
    worker = _spawn(host_worker_argv(sys.executable, host), env, logs / "worker.log")
    base = f"http://127.0.0.1:{web_port}"
    pages_base = f"http://127.0.0.1:{pages_port}"
    http = requests.Session()
    http.headers["Authorization"] = f"Bearer {token}"

    def get(path: str) -> requests.Response:
        return http.get(f"{base}{path}", timeout=10)

    try:
        wait_for(lambda: healthz_answers(base), 30, "the web server")
        wait_for(lambda: get("/api/hosts/").json().get("count"), 60, "the host's first beat")
        registered = http.post(
            f"{base}/api/models/", json={"name": "minilm", "kind": "embedding", "path": str(minilm_path), "host": host}
        )
        assert registered.status_code == 201, registered.text
        wait_for(lambda: get("/api/models/").json()["results"][0]["inspection"] == "ready", 60, "the inspection")
        created = http.post(
            f"{base}/api/deployments/", json={"name": "pg", "host": host, "models": [{"model": "minilm"}]}
        ).json()
        url = f"/api/deployments/{created['id']}/"
        assert http.post(f"{base}{url}start/").status_code == 202
        wait_for(lambda: get(url).json()["status"] == "ready", 240, "the deployment to be ready")
        [(server, repository)] = process.servers_under(data_dir)
        alias = {"name": "embedder", "deployment": created["id"], "model": "minilm"}
        assert http.post(f"{base}/api/gateway/aliases/", json=alias).status_code == 201
        keys = [
            http.post(f"{base}/api/gateway/keys/", json={"name": name, "all_aliases": True})
            for name in ("seen", "unseen")
        ]
        assert [k.status_code for k in keys] == [201, 201], keys[0].text
        seen, unseen = (k.json()["key"] for k in keys)

        def embed(key: str) -> requests.Response:
            body = {"model": "embedder", "input": "the database is away"}
            return requests.post(
                f"{base}/v1/embeddings", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
            )

        assert embed(seen).status_code == 200

        assert http.get(f"{pages_base}{url}", timeout=10).status_code == 200  # its process's connection, kept

        own_postgres.stop()
        down = get(url)
        assert down.status_code == 503, down.text
        assert down.json()["code"] == "database_unavailable" and down.headers["Retry-After"] == "5"
        # The pages server (one kept connection per process) says the same, not a 500.
        down = http.get(f"{pages_base}{url}", timeout=10)
        assert down.status_code == 503 and down.json()["code"] == "database_unavailable", down.text
        assert process.is_running(server, repository)  # Triton does not need the database to serve
        # The gateway keeps serving a key it has seen, and answers others in OpenAI's shape. Its
        # breaker opens once a read fails or waits: no request waits on the connection pool, whose
        # timeout (DATABASE_POOL_TIMEOUT, 10 s) each read used to wait in turn (27-30 s a request).
        # How close to its normal latency it stays is bench/gateway.py's figure, not asserted here.
        served, slowest, until = [], 0.0, time.monotonic() + 14  # past one pool timeout
        while time.monotonic() < until:
            answer = embed(seen)
            served.append(answer.status_code)
            slowest = max(slowest, answer.elapsed.total_seconds())
            time.sleep(0.2)
        assert served and set(served) == {200}, served
        assert slowest < POOL_TIMEOUT_S, f"a request waited {slowest:.1f}s: on the pool"
        assert len(answer.json()["data"][0]["embedding"]) == 384
        refused = embed(unseen)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "5", refused.text
        assert refused.json()["error"]["code"] == "service_unavailable"
        assert refused.elapsed.total_seconds() < POOL_TIMEOUT_S, refused.elapsed
        own_postgres.start()

        # The connection pool retries with a doubling delay (1, 2, 4, 8, 16 s after the first
        # failure), so on a busy machine its next try may come some 30 s after the return.
        wait_for(lambda: healthz_answers(base) and get(url).status_code == 200, 60, "the API to answer again")
        wait_for(lambda: http.get(f"{pages_base}{url}", timeout=10).ok, 30, "the pages server to answer again")
        events = lambda: [e["kind"] for e in get(f"/api/events/?host={host}&limit=100").json()["results"]]  # noqa: E731
        wait_for(lambda: "host.agent_recovered" in events(), 60, "the agent to say it recovered")
        assert get(url).json()["status"] == "ready"
        assert process.servers_under(data_dir) == [(server, repository)]
        assert http.post(f"{base}{url}stop/").status_code == 202
        wait_for(lambda: get(url).json()["status"] == "stopped", 60, "the deployment to stop")
        assert process.servers_under(data_dir) == []
    finally:
        stop_process(worker)
        stop_process(web)
        stop_process(pages)
        clean_up([data_dir], logs)


def test_a_server_a_dead_worker_started_without_recording_it_is_stopped_before_a_new_launch(tmp_path: Path):
    """The state a worker SIGKILLed between starting tritonserver and recording it
    leaves: a real server nobody's row names, holding the deployment's ports."""
    from triton_server.server import LaunchSpec
    from workers import processes
    from workers.runtimes.base import busy_ports
    from workers.runtimes.process import ProcessRuntime, _triton_dist, server_environment

    repository = tmp_path / "deployments" / "7-leftover" / "repository"
    repository.mkdir(parents=True)
    port = free_ports(3)
    argv = [
        str(_triton_dist() / "bin" / "tritonserver"), f"--model-repository={repository}",
        "--model-control-mode=explicit", "--http-address=127.0.0.1", f"--http-port={port}",
        "--grpc-address=127.0.0.1", f"--grpc-port={port + 1}", "--metrics-address=127.0.0.1",
        f"--metrics-port={port + 2}",
    ]  # fmt: skip
    server = processes.start_group(argv, env=server_environment(), stdout=subprocess.DEVNULL)
    wait_for(lambda: busy_ports("127.0.0.1", [port]), 30, "the leftover server to listen")
    spec = LaunchSpec(
        deployment_id=7, generation=1, repository=repository, models=[], http_port=port, grpc_port=port + 1,
        metrics_port=port + 2, log_path=tmp_path / "server.log",
    )  # fmt: skip
    assert ProcessRuntime(tmp_path).stop_leftovers(spec) == [str(server.pid)]
    assert process.servers_under(tmp_path) == []
    assert busy_ports("127.0.0.1", [port, port + 1, port + 2]) == []


@pytest.mark.parametrize("after_s", [0.0, 0.8])
def test_a_worker_killed_early_in_a_launch_converges_to_one_ready_server(
    stack: Stack, minilm_path: Path, after_s: float
):
    """SIGKILLed at once (the launch task not yet run, or just taken) and a moment
    later (tritonserver starting, maybe not yet recorded): the next worker
    re-drives the launch at its start and it ends ready, with one server."""
    deployment_id = _deploy(stack, minilm_path)
    time.sleep(after_s)
    os.killpg(stack.worker.pid, signal.SIGKILL)
    stack.worker.wait()
    phase = _status(deployment_id)
    stack.start_worker()
    wait_for(lambda: _status(deployment_id) == "ready", 240, f"the launch killed while {phase} to converge")
    server = factories.replica_row(deployment_id).runtime_handle
    assert [h for h, _ in process.servers_under(stack.data_dir)] == [server], phase
    assert not Event.objects.filter(deployment_id=deployment_id, to_status="failed").exists(), phase
    stack.session().post(f"{stack.web_url}/api/deployments/{deployment_id}/stop/", timeout=30)
    wait_for(lambda: _status(deployment_id) == "stopped", 60, "the deployment to stop")


@pytest.fixture
def docker_stack_on_own_redis(transactional_db, tmp_path: Path, operator, own_redis: RedisServer):  # noqa: ANN001, ANN201
    """A stack whose Redis the test may restart, whose worker waits at most a second
    on a call to Triton (a model load may take as long as a launch)."""
    extra = {"REDIS_URL": own_redis.url, "GANTRY_TRITON_REQUEST_TIMEOUT": "1"}
    yield from make_stack(tmp_path, operator, extra_env=extra)


def test_the_docker_runtime_ends_where_it_should_through_a_failed_restart_a_long_load_and_a_redis_restart(
    docker_stack_on_own_redis: Stack, own_redis: RedisServer, minilm_path: Path, tmp_path: Path
):
    """One container deployment, three blows:
    - a generation that needs a new container and fails to load in it (a surge
      replica beside the serving one): rolled back, the surge replica removed,
      and the first container serving throughout;
    - a reload whose model load outlasts the worker's Triton request timeout: it
      is waited for, not taken for a failure and rolled back;
    - Redis restarted, empty, under a load test through the gateway: the run
      ends succeeded with its figures, and the deployment stays as it was."""
    import shutil

    import docker

    stack = docker_stack_on_own_redis
    http = stack.session()
    broken = tmp_path / "broken"
    shutil.copytree(minilm_path, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    stack.register_models(minilm_path, minilm="embedding")
    stack.register_models(broken, broken="embedding")
    image = os.environ["GANTRY_TEST_TRITON_IMAGE"]
    body = {"name": "blows", "host": stack.host_name, "runtime": "docker", "image": image}
    created = http.post(f"{stack.web_url}/api/deployments/", json={**body, "models": [{"model": "minilm"}]}, timeout=30)
    assert created.status_code == 201, created.text
    deployment_id = created.json()["id"]
    url = f"{stack.web_url}/api/deployments/{deployment_id}/"

    def ready_at(generation: int) -> bool:
        current = http.get(url, timeout=10).json()
        assert current["status"] != "failed", current["status_message"]
        return current["status"] == "ready" and current["generation"] == generation

    engine = docker.from_env()
    containers = lambda: engine.containers.list(filters={"label": f"gantry.host={stack.host_name}"})  # noqa: E731
    try:
        http.post(url + "start/", timeout=30)
        wait_for(lambda: ready_at(1), 300, "generation 1")
        first = factories.replica_row(deployment_id).runtime_handle

        # 1. A new folder needs a new container; the broken checkpoint fails to load in it
        #    (in a surge replica started beside the serving one).
        changed = http.put(url + "models/", json={"models": [{"model": "minilm"}, {"model": "broken"}]}, timeout=30)
        assert changed.status_code == 202, changed.text
        wait_for(lambda: _kinds(deployment_id=deployment_id) >= {"deployment.rollback"}, 300, "the rollback")
        wait_for(lambda: ready_at(1), 300, "generation 1 again")
        # The host had room, so generation 2 went to a surge replica: r1 kept its
        # container and served throughout, and the failed surge replica is removed.
        assert factories.replica_row(deployment_id).runtime_handle == first
        wait_for(lambda: _kinds(deployment_id=deployment_id) >= {"replica.removed"}, 60, "the surge's removal")
        assert Replica.objects.filter(deployment_id=deployment_id).count() == 1
        rollback = Event.objects.get(deployment_id=deployment_id, kind="deployment.rollback")
        assert "generation 2 failed" in rollback.message and "tritonserver" in rollback.message
        revisions = http.get(url + "revisions/", timeout=30).json()["results"]
        assert [(r["generation"], r["status"]) for r in revisions] == [(1, "current"), (2, "failed")]
        [container] = containers()
        assert str(broken.resolve()) not in {m["Source"] for m in container.attrs["Mounts"]}
        assert http.post(url + "embed/", json={"texts": ["a"]}, timeout=60).status_code == 200

        # 2. A reload in place whose load takes longer than a Triton request may.
        changed = http.put(url + "models/", json={"models": [{"model": "minilm", "max_batch_size": 8}]}, timeout=30)
        assert changed.status_code == 202, changed.text
        wait_for(lambda: ready_at(3), 300, "generation 3")
        applied = Event.objects.get(deployment_id=deployment_id, kind="deployment.generation_applied")
        asked = Event.objects.filter(deployment_id=deployment_id, kind="deployment.changed").latest("id")
        took = (applied.created_at - asked.created_at).total_seconds()
        assert took > 1, f"the load took {took:.1f}s, within the request timeout: nothing was shown"
        assert Event.objects.filter(deployment_id=deployment_id, kind="deployment.rollback").count() == 1

        # 3. Redis restarted under a load test through the gateway.
        from tests.integration.test_gateway import _alias
        from tests.integration.test_loadtests import _ended, _start, _under_load

        _alias(stack, "blows-embed", {"id": deployment_id}, "minilm")
        run = _start(stack, {"id": deployment_id}, "blows-embed", {"levels": [1], "duration_s": 20})
        _under_load(stack, run["id"], {"id": deployment_id}, "minilm")
        own_redis.stop()
        time.sleep(2)
        own_redis.start()
        run = _ended(stack, run["id"], 180)
        assert run["status"] == "succeeded", run["status_message"]
        assert run["points"] and run["points"][0]["summary"]["counted"]["requests"] > 0
        assert ready_at(3) and len(containers()) == 1
        assert http.post(url + "stop/", timeout=30).status_code == 202
        wait_for(lambda: _status(deployment_id) == "stopped", 120, "the stop")
        assert containers() == []
    finally:
        for leftover in engine.containers.list(all=True, filters={"label": f"gantry.host={stack.host_name}"}):
            leftover.remove(force=True)
        engine.close()
