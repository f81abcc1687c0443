"""The product image as a user runs it: web, live and a GPU host's worker each
started from it (`gantry web|live|worker`, host networking) against the test
PostgreSQL and Redis; a deployment of the packaged MiniLM taken to ready by
the worker inside its container, and answered through /v1. The image is built
by make test (scripts/build-product-image.sh) from local bases."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import docker
import pytest
import requests
from django.conf import settings

from access.services import token_create
from hosts.models import GpuHost
from tests.integration.conftest import (
    _other_sessions,
    built_image,
    free_port,
    free_ports,
    healthz_answers,
    spawned_database_url,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def product_image() -> str:
    return built_image("GANTRY_TEST_PRODUCT_IMAGE")


def test_web_live_and_a_worker_from_the_image_serve_a_deployment_through_v1(
    product_image: str, operator, tmp_path: Path, minilm_path: Path
):
    host = f"img-{uuid.uuid4().hex[:8]}"
    web_port, live_port, triton = free_port(), free_port(), free_ports(30)
    data = tmp_path / "data"
    data.mkdir()
    env = {
        "DATABASE_URL": spawned_database_url(),
        "REDIS_URL": settings.REDIS_URL,
        "SECRET_KEY": "the-image-test-key",
        "GANTRY_PLAIN_HTTP": "1",
        "GANTRY_HOST_NAME": host,
        "GANTRY_DATA_DIR": str(data),
        "GANTRY_MODEL_ROOTS": str(minilm_path),
        "GANTRY_HEARTBEAT_INTERVAL": "1",
        "GANTRY_TRITON_PORT_RANGE": f"{triton}-{triton + 29}",
        "GANTRY_LIVE_PORT": str(live_port),
        "GANTRY_GATEWAY_URL": f"http://127.0.0.1:{web_port}",
    }
    engine = docker.from_env()
    started = []

    def run(*command: str, **options) -> None:  # noqa: ANN003
        labels = {"gantry.test": "product-image"}
        container = engine.containers.run(
            product_image, list(command), detach=True, network_mode="host", environment=env, labels=labels, **options
        )
        started.append(container)

    web_url = f"http://127.0.0.1:{web_port}"
    try:
        run("gantry", "web", "--bind", "127.0.0.1", "--port", str(web_port), "--workers", "1")
        run("gantry", "live", "--bind", "127.0.0.1", "--port", str(live_port))
        folders = {str(data): {"bind": str(data), "mode": "rw"}, str(minilm_path): {"bind": str(minilm_path)}}
        run("gantry", "worker", volumes=folders, shm_size="1g")
        wait_for(lambda: healthz_answers(web_url), 60, "the web server from the image")
        wait_for(lambda: GpuHost.objects.filter(name=host).exists(), 90, "the worker's first heartbeat")
        http = requests.Session()
        http.headers["Authorization"] = f"Bearer {token_create(user=operator, name='image').secret}"

        model = http.post(
            f"{web_url}/api/models/",
            json={"name": "minilm", "kind": "embedding", "path": str(minilm_path), "host": host},
            timeout=30,
        )
        assert model.status_code == 201, model.text
        model_url = f"{web_url}/api/models/{model.json()['id']}/"
        wait_for(lambda: http.get(model_url, timeout=10).json()["inspection"] == "ready", 60, "the inspection")
        created = http.post(
            f"{web_url}/api/deployments/",
            json={"name": "boxed", "host": host, "models": [{"model": "minilm"}]},
            timeout=30,
        )
        assert created.status_code == 201, created.text
        url = f"{web_url}/api/deployments/{created.json()['id']}/"
        assert http.post(url + "start/", timeout=30).status_code == 202

        def ready() -> bool:
            current = http.get(url, timeout=10).json()
            assert current["status"] != "failed", current["status_message"]
            return current["status"] == "ready"

        wait_for(ready, 300, "the deployment from the image's worker")
        alias = {"name": "image-embed", "deployment": created.json()["id"], "model": "minilm"}
        assert http.post(f"{web_url}/api/gateway/aliases/", json=alias, timeout=30).status_code == 201
        key = http.post(f"{web_url}/api/gateway/keys/", json={"name": "k", "all_aliases": True}, timeout=30)
        assert key.status_code == 201, key.text
        answer = requests.post(
            f"{web_url}/v1/embeddings",
            headers={"Authorization": f"Bearer {key.json()['key']}"},
            json={"model": "image-embed", "input": ["a cat", "a kitten"]},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        assert [len(item["embedding"]) for item in answer.json()["data"]] == [384, 384]
        assert http.post(url + "stop/", timeout=30).status_code == 202
        wait_for(lambda: http.get(url, timeout=10).json()["status"] == "stopped", 120, "the stop")
    finally:
        for container in started:
            tail = container.logs(tail=30).decode(errors="replace")
            sys.stderr.write(f"--- {' '.join(container.attrs['Config']['Cmd'])} ---\n{tail}\n")
            container.remove(force=True)
        engine.close()
        wait_for(lambda: _other_sessions() == 0, 30, "the containers' database sessions to close")
