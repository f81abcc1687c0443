"""The docker runtime with the real Docker engine and a locally built Triton
image: a two-model deployment in one container, a killed and then an
OOM-killed container each named and restarted, and a container no deployment
wants removed."""

from __future__ import annotations

from pathlib import Path

import docker
import pytest
import requests

from core.models import Event
from deployments.models import Deployment
from tests import factories
from tests.integration.conftest import Stack, built_image, wait_for
from tests.integration.test_end_to_end import _socket, _stop, _wait_for_status

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def image() -> str:
    return built_image("GANTRY_TEST_TRITON_IMAGE")


@pytest.fixture
def engine():
    client = docker.from_env()
    yield client
    client.close()


def _containers(engine, stack: Stack):
    # docker-py lists, then inspects each container: one removed in between (by the
    # agent, which is what some tests wait for) raises NotFound; list again.
    for _ in range(5):
        try:
            return engine.containers.list(all=True, filters={"label": f"gantry.host={stack.host_name}"})
        except docker.errors.NotFound:
            continue
    return engine.containers.list(all=True, filters={"label": f"gantry.host={stack.host_name}"})


def test_two_models_in_one_container_restarted_after_a_kill(stack: Stack, minilm_path: Path, image: str, engine):
    http = stack.session()
    stack.register_models(minilm_path, minilm="embedding", **{"minilm-rerank": "reranker"})
    created = http.post(
        f"{stack.web_url}/api/deployments/",
        json={
            "name": "boxed",
            "host": stack.host_name,
            "runtime": "docker",
            "image": image,
            "models": [{"model": "minilm"}, {"model": "minilm-rerank"}],
        },
        timeout=30,
    )
    assert created.status_code == 201, created.text
    deployment_id = created.json()["id"]
    try:
        with _socket(stack, deployment_id) as socket:
            http.post(f"{stack.web_url}/api/deployments/{deployment_id}/start/", timeout=30)
            _wait_for_status(socket, "ready", timeout_s=300)

            [container] = _containers(engine, stack)
            assert container.labels["gantry.deployment"] == str(deployment_id)
            assert container.labels["gantry.generation"] == "1"
            assert container.attrs["HostConfig"]["NetworkMode"] == "host"
            assert container.attrs["HostConfig"]["Privileged"] is False
            assert all(m["RW"] is False for m in container.attrs["Mounts"])
            # The server took the admin secret: its repository API answers the deployment's key
            # only; the container's environment (which model code inherits) does not hold it.
            secret = Deployment.objects.get(pk=deployment_id).admin_secret
            assert secret not in repr(container.attrs["Config"]["Env"])
            port = factories.replica_row(deployment_id).http_port
            index = f"http://127.0.0.1:{port}/v2/repository/index"
            assert requests.post(index, headers={"gantry-admin-key": secret}, timeout=10).status_code == 200
            assert requests.post(index, timeout=10).status_code == 403

            embedded = http.post(
                f"{stack.web_url}/api/deployments/{deployment_id}/embed/", json={"texts": ["a", "b"]}, timeout=60
            )
            assert embedded.status_code == 200 and len(embedded.json()["embeddings"][0]) == 384
            ranked = http.post(
                f"{stack.web_url}/api/deployments/{deployment_id}/rerank/",
                json={"query": "GPU inference server", "passages": ["a banana", "Triton serves models on GPUs"]},
                timeout=60,
            )
            assert ranked.status_code == 200 and ranked.json()["order"] == [1, 0]

            container.kill()  # the server dies under us
            seen = _wait_for_status(socket, "failed", timeout_s=30)
            assert seen[-1]["message"].startswith("tritonserver exited unexpectedly: killed by SIGKILL")
            _wait_for_status(socket, "ready", timeout_s=300)

            # Then the kernel's OOM killer, for real: the new container is held just above
            # what it uses, its server made the OOM killer's first choice, and a process
            # inside asks for a gigabyte.
            [replacement] = _containers(engine, stack)
            Path(f"/proc/{replacement.attrs['State']['Pid']}/oom_score_adj").write_text("1000")
            limit = replacement.stats(stream=False)["memory_stats"]["usage"] + 64 * 2**20
            replacement.update(mem_limit=limit, memswap_limit=limit)
            replacement.exec_run(["python3", "-c", "bytearray(1 << 30)"], detach=True)
            seen = _wait_for_status(socket, "failed", timeout_s=60)
            assert seen[-1]["message"] == (
                "tritonserver exited unexpectedly: killed by the kernel's OOM killer (out of memory)"
            )
            assert seen[-1]["data"]["exit"]["oom_killed"] is True
            _wait_for_status(socket, "ready", timeout_s=300)  # restarted, in a container without that limit
        row = factories.replica_row(deployment_id)
        assert row.runtime_handle not in (container.id, replacement.id)
        assert Event.objects.filter(deployment=row.deployment, kind="deployment.crash_restart").count() == 2
        assert [c.id for c in _containers(engine, stack)] == [row.runtime_handle]
        _stop(stack, deployment_id)
        assert _containers(engine, stack) == []
    finally:
        for leftover in _containers(engine, stack):
            leftover.remove(force=True)


def test_container_no_deployment_wants_is_removed(stack: Stack, image: str, engine):
    stray = engine.containers.run(
        image,
        ["sleep", "300"],
        detach=True,
        network_mode="host",
        labels={"gantry.host": stack.host_name, "gantry.deployment": "999999", "gantry.generation": "1"},
    )
    try:
        wait_for(lambda: not _containers(engine, stack), 45, "the agent to remove the stray container")
        # The agent records the removal after it: wait for the event too.
        event = wait_for(
            lambda: Event.objects.filter(kind="host.container_removed", host__name=stack.host_name).first(),
            15,
            "the removal on the host's timeline",
        )
        assert stray.id[:12] in event.message
    finally:
        try:
            stray.remove(force=True)
        except docker.errors.NotFound:
            pass


def test_a_new_generation_reaches_a_running_container_even_with_new_folders(
    stack: Stack, minilm_path: Path, image: str, engine, tmp_path: Path
):
    """The repository is rewritten beside the old one and swapped in by renaming,
    and a new generation may name a checkpoint the container has never seen: a
    new container, started first as a surge replica while the old one serves."""
    import shutil

    import requests

    copy = tmp_path / "minilm-copy"
    shutil.copytree(minilm_path, copy)
    http = stack.session()
    stack.register_models(minilm_path, minilm="embedding")
    stack.register_models(copy, elsewhere="embedding")
    created = http.post(
        f"{stack.web_url}/api/deployments/",
        json={
            "name": "regen",
            "host": stack.host_name,
            "runtime": "docker",
            "image": image,
            "models": [{"model": "minilm"}],
        },
        timeout=30,
    ).json()
    url = f"{stack.web_url}/api/deployments/{created['id']}/"

    def ready_at(generation: int):  # noqa: ANN202
        def check() -> dict | None:
            current = http.get(url, timeout=10).json()
            assert current["status"] != "failed", current["status_message"]
            return current if current["status"] == "ready" and current["generation"] == generation else None

        return check

    def triton_config(name: str) -> dict:
        row = factories.replica_row(created["id"])
        return requests.get(f"http://127.0.0.1:{row.http_port}/v2/models/{name}/config", timeout=10).json()

    try:
        http.post(url + "start/", timeout=30)
        wait_for(ready_at(1), 300, "generation 1")
        # Same folders, new batching: applied in place, and the container sees the new config.
        changed = http.put(url + "models/", json={"models": [{"model": "minilm", "max_batch_size": 8}]}, timeout=30)
        assert changed.status_code == 202, changed.text
        wait_for(ready_at(2), 300, "generation 2")
        wait_for(
            lambda: triton_config("minilm").get("max_batch_size") == 8, 30, "the container to serve the new config"
        )
        # A checkpoint in a folder the container was not started with: a new container.
        # The host has room, so it surges: a second replica of generation 3 starts beside
        # the first, which serves generation 2 until then and is retired after.
        moved = http.put(url + "models/", json={"models": [{"model": "elsewhere"}]}, timeout=30)
        assert moved.status_code == 202, moved.text

        def surged() -> dict | None:
            current = ready_at(3)()
            rows = current["replica_set"] if current else []
            return current if [(r["serial"], r["generation"]) for r in rows] == [(2, 3)] else None

        wait_for(surged, 300, "generation 3 on a surge replica, the old one retired")
        timeline = [e["message"] for e in http.get(url + "events/?limit=200", timeout=10).json()["results"]]
        assert any("surge for generation 3" in m for m in timeline), timeline
        assert any("r1" in m and "removed" in m for m in timeline), timeline
        assert triton_config("elsewhere")["parameters"]["checkpoint_path"]["string_value"] == str(copy.resolve())
        [container] = _containers(engine, stack)
        assert str(copy.resolve()) in {m["Source"] for m in container.attrs["Mounts"]}
        embedded = http.post(url + "embed/", json={"texts": ["a"]}, timeout=60)
        assert embedded.status_code == 200, embedded.text
        _stop(stack, created["id"])
    finally:
        for leftover in _containers(engine, stack):
            leftover.remove(force=True)


def test_a_container_log_docker_cannot_read_is_an_error_that_names_the_cause(image: str, engine, tmp_path: Path):
    """A container whose logging driver keeps nothing: reading its log says so
    (for the timeline, a failure's tail and a build's log) instead of an empty log."""
    from common.errors import TransientError
    from tests import factories
    from workers.runtimes.docker import BuildContainer, DockerRuntime

    container = engine.containers.run(
        image, ["sleep", "60"], detach=True, log_config={"type": "none"}, labels={"gantry.test": "unreadable-log"}
    )
    try:
        runtime = DockerRuntime("unreadable", tmp_path)
        spec = factories.launch_spec(tmp_path)
        with pytest.raises(TransientError, match=f"could not read the log of container {container.id[:12]}"):
            runtime.read_log(container.id, spec, None)
        assert runtime.log_tail(container.id, spec).startswith("(Docker could not read the container's log: ")
        build = BuildContainer.__new__(BuildContainer)  # a build step's stream over the same container
        build.handle = container.id
        [said] = list(build.stream())
        assert said.startswith("[gantry] Docker stopped streaming this build's log: ")
    finally:
        container.remove(force=True)
