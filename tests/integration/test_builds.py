"""Engine builds end to end: the REST API, a real Celery worker on a host with
stand-in GPUs, the real Docker engine running the locally made builder image
(tests/fixtures: the TensorRT-LLM stand-in), and a real websocket."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
from django.contrib.auth.models import User
from websockets.sync.client import connect

from controlplane.celery import app as celery_app
from core.queues import jobs_queue
from deployments.models import BuildLogLine, BuildStatus, EngineBuild
from tests.factories import LLAMA, write_checkpoint
from tests.fixtures.trtllm_tree import lay_out
from tests.integration.conftest import ROOT, RedisServer, Stack, built_image, make_stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

VERSION = "0.16.0"
STANDIN_GPUS = [
    {"index": i, "uuid": f"GPU-standin-{i}", "name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0",
     "memory_total_bytes": 85_520_809_984}
    for i in range(2)
]  # fmt: skip


@pytest.fixture
def builder_image() -> str:
    return built_image("GANTRY_TEST_BUILDER_IMAGE")


@pytest.fixture
def build_stack(transactional_db, tmp_path: Path, operator: User, builder_image: str) -> Iterator[Stack]:  # noqa: ANN001
    """A GPU host with two stand-in H100s, the builder image allow-listed, and the
    stand-in toolchain installed natively as well."""
    yield from _build_stack(tmp_path, operator, builder_image)


@pytest.fixture
def build_stack_on_own_redis(
    transactional_db,
    tmp_path: Path,
    operator: User,
    builder_image: str,
    own_redis: RedisServer,  # noqa: ANN001
) -> Iterator[Stack]:
    yield from _build_stack(tmp_path, operator, builder_image, REDIS_URL=own_redis.url)


def _build_stack(tmp_path: Path, operator: User, builder_image: str, **more_env: str) -> Iterator[Stack]:
    tree = lay_out(tmp_path / "native-trtllm", VERSION)
    env = {
        "GANTRY_BUILDER_IMAGES": f"{builder_image}={VERSION}",
        "GANTRY_STANDIN_GPUS": json.dumps(STANDIN_GPUS),
        "GANTRY_TRTLLM_PYTHON": sys.executable,
        "GANTRY_TRTLLM_EXAMPLES_DIR": str(tree / "examples"),
        "GANTRY_BUILD_LOG_LINES": "1000",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(tree / "site")]),
        "TRTLLM_STANDIN_VERSION": VERSION,
        **more_env,
    }
    worker = [sys.executable, str(ROOT / "tests/fixtures/standin_gpu_worker.py"), "{host}"]
    yield from make_stack(tmp_path, operator, extra_env=env, worker_argv=worker)


@pytest.fixture
def engine():
    client = docker.from_env()
    yield client
    client.close()


def _register(stack: Stack, tmp_path: Path, name: str, standin: dict | None = None) -> None:
    config = {**LLAMA, "gantry_standin": standin or {}}
    stack.register_models(write_checkpoint(tmp_path / name, config), **{name: "llm"})
    http = stack.session()
    url = f"{stack.web_url}/api/hosts/{stack.host_name}/"
    wait_for(lambda: len(http.get(url, timeout=10).json()["gpus"]) == 2, 30, "the stand-in GPUs reported")


def _request(stack: Stack, model: str, image: str, **extra) -> dict:  # noqa: ANN003
    body = {"model": model, "host": stack.host_name, "image": image, **extra}
    response = stack.session().post(f"{stack.web_url}/api/builds/", json=body, timeout=30)
    assert response.status_code in (200, 201), response.text
    return response.json()


def _model_id(stack: Stack, name: str) -> int:
    models = stack.session().get(f"{stack.web_url}/api/models/?limit=500", timeout=10).json()["results"]
    return next(m["id"] for m in models if m["name"] == name)


def _build(stack: Stack, build_id: int) -> dict:
    return stack.session().get(f"{stack.web_url}/api/builds/{build_id}/", timeout=10).json()


def _wait_status(stack: Stack, build_id: int, status: str, timeout_s: float = 90) -> dict:
    def reached() -> dict | None:
        build = _build(stack, build_id)
        assert build["status"] not in ({"succeeded", "failed", "cancelled"} - {status}), build
        return build if build["status"] == status else None

    return wait_for(reached, timeout_s, f"build {build_id} {status}", interval_s=0.5)


def _build_containers(engine, build_id: int) -> list:  # noqa: ANN001
    return engine.containers.list(all=True, filters={"label": f"gantry.build={build_id}"})


def test_docker_build_streams_its_log_live_and_records_the_engine(build_stack: Stack, builder_image: str, tmp_path):
    stack = build_stack
    _register(stack, tmp_path, "llama", {"rank_sleep_s": 1.5, "lines": 3000})
    build = _request(stack, "llama", builder_image, spec={"tp_size": 2, "workers": 2, "max_batch_size": 16})
    assert build["how"] == "queued" and build["status"] == "pending"

    headers = {"Authorization": f"Bearer {stack.token}", "Origin": stack.web_url}
    log_messages, lines, phases = 0, [], set()
    with connect(f"{stack.ws_url}/ws/builds/{build['id']}/", additional_headers=headers) as socket:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            message = json.loads(socket.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message["type"] == "log":
                log_messages += 1
                lines += message["lines"]
            if message["type"] == "build":
                phases.add(message["phase"])
            if message["type"] == "event" and message["to_status"] in ("succeeded", "failed"):
                break
    done = _build(stack, build["id"])
    assert done["status"] == "succeeded", (done["status_message"], done["hint"])
    # Live: every line reached the socket, in batches rather than one message per line.
    assert any("Engine generated for rank 1" in line for line in lines)
    assert sum("optimization pass" in line for line in lines) == 3000
    assert log_messages < 200, log_messages
    assert {"converting", "building rank 1 of 2", "building rank 2 of 2"} <= phases, phases
    # Stored: only the newest GANTRY_BUILD_LOG_LINES.
    assert BuildLogLine.objects.filter(build_id=build["id"]).count() == 1000
    # Recorded: each artifact with its real size and sha256, and what the engine says it is.
    engine_dir = Path(done["output_dir"])
    assert sorted(a["name"] for a in done["artifacts"]) == ["config.json", "rank0.engine", "rank1.engine"]
    for artifact in done["artifacts"]:
        assert artifact["size"] == (engine_dir / artifact["name"]).stat().st_size
    assert done["trtllm_version"] == VERSION and done["compute_capability"] == "9.0"
    assert done["image_digest"].startswith("sha256:")
    assert done["build_config"]["max_batch_size"] == 16 and done["plugin_config"]["gemm_plugin"] == "float16"
    assert list((stack.data_dir / "timing-cache").glob("nvidia-h100-80gb-hbm3-*.cache"))
    # Built once: the same request is answered with this build.
    again = _request(stack, "llama", builder_image, spec={"tp_size": 2, "workers": 2, "max_batch_size": 16})
    assert again["how"] == "cached" and again["id"] == build["id"]


def test_failure_ends_with_exit_code_tail_and_hint(build_stack: Stack, builder_image: str, tmp_path, engine):
    _register(build_stack, tmp_path, "oom", {"fail": "oom"})
    build = _request(build_stack, "oom", builder_image)
    failed = _wait_status(build_stack, build["id"], "failed")
    assert failed["exit_code"] == 1
    assert "building failed with exit code 1" in failed["status_message"]
    assert "out of memory" in failed["status_message"]  # the last log lines
    assert "ran out of memory" in failed["hint"]
    assert _build_containers(engine, build["id"]) == []


def test_cancel_and_time_limit_stop_the_container(build_stack: Stack, builder_image: str, tmp_path, engine):
    _register(build_stack, tmp_path, "hangs", {"hang": True})
    build = _request(build_stack, "hangs", builder_image)
    wait_for(lambda: _build(build_stack, build["id"])["phase"] == "building rank 1 of 1", 60, "the build step")
    assert len(_build_containers(engine, build["id"])) == 1
    response = build_stack.session().post(f"{build_stack.web_url}/api/builds/{build['id']}/cancel/", timeout=10)
    assert response.status_code == 202 and response.json()["status"] == "cancelling"
    _wait_status(build_stack, build["id"], "cancelled", 60)
    assert _build_containers(engine, build["id"]) == []

    limited = _request(build_stack, "hangs", builder_image, time_limit_s=10, spec={"max_batch_size": 4})
    failed = _wait_status(build_stack, limited["id"], "failed", 60)
    assert "stopped at the time limit of 10 s" in failed["status_message"]
    assert _build_containers(engine, limited["id"]) == []


def test_control_work_never_waits_behind_long_jobs(build_stack: Stack, builder_image: str, tmp_path, engine):
    """Two builds that never end hold the host's job slots; a checkpoint registered
    meanwhile is still inspected (control work has its own worker and slots)."""
    stack = build_stack
    _register(stack, tmp_path, "hangs", {"hang": True})
    builds = [_request(stack, "hangs", builder_image, spec={"max_batch_size": size}) for size in (4, 8)]
    for build in builds:
        wait_for(lambda b=build: _build(stack, b["id"])["phase"] == "building rank 1 of 1", 60, "both build steps")

    stack.register_models(write_checkpoint(tmp_path / "late", LLAMA), late="llm")  # waits for its inspection

    for build in builds:
        stack.session().post(f"{stack.web_url}/api/builds/{build['id']}/cancel/", timeout=10)
    for build in builds:
        _wait_status(stack, build["id"], "cancelled", 60)
    assert all(_build_containers(engine, build["id"]) == [] for build in builds)


def test_native_build_runs_the_hosts_own_toolchain(build_stack: Stack, tmp_path):
    _register(build_stack, tmp_path, "native", {})
    build = _request(build_stack, "native", "native")
    done = _wait_status(build_stack, build["id"], "succeeded")
    assert done["executor"] == "native" and done["image_digest"] == f"native:tensorrt_llm-{VERSION}"
    assert sorted(a["name"] for a in done["artifacts"]) == ["config.json", "rank0.engine"]


def test_worker_killed_during_a_build_never_leaves_it_running(build_stack: Stack, builder_image: str, tmp_path, engine):
    stack = build_stack
    _register(stack, tmp_path, "killed", {"hang": True})
    build = _request(stack, "killed", builder_image)
    wait_for(lambda: _build(stack, build["id"])["phase"] == "building rank 1 of 1", 60, "the build step")
    os.killpg(stack.worker.pid, signal.SIGKILL)
    stack.worker.wait()
    assert [c.status for c in _build_containers(engine, build["id"])] == ["running"]  # left behind

    stack.start_worker()
    failed = _wait_status(stack, build["id"], "failed", 90)
    assert "the worker running this build stopped" in failed["status_message"]
    wait_for(lambda: _build_containers(engine, build["id"]) == [], 30, "the orphaned container removed")

    # The broker redelivers the lost task later: it must not compile again.
    celery_app.send_task("workers.tasks.run_build", args=[build["id"]], queue=jobs_queue(stack.host_name))
    time.sleep(3)
    assert EngineBuild.objects.get(pk=build["id"]).status == BuildStatus.FAILED
    assert _build_containers(engine, build["id"]) == []


def test_redis_restarted_during_a_build_loses_nothing(
    build_stack_on_own_redis: Stack, own_redis: RedisServer, builder_image: str, tmp_path, engine
):
    """Redis stops and comes back, empty, while a build runs: the build goes on
    (its worker keeps its state in the database), ends succeeded with its whole
    log stored, and compiles once."""
    stack = build_stack_on_own_redis
    _register(stack, tmp_path, "steady", {"rank_sleep_s": 4, "lines": 200})
    build = _request(stack, "steady", builder_image, spec={"max_batch_size": 8})
    _wait_status(stack, build["id"], "running", 60)  # then it sleeps 4 s before its engine
    own_redis.stop()
    time.sleep(2)
    own_redis.start()
    done = _wait_status(stack, build["id"], "succeeded", 120)
    assert sorted(a["name"] for a in done["artifacts"]) == ["config.json", "rank0.engine"]
    stored = BuildLogLine.objects.filter(build_id=build["id"]).values_list("line", flat=True)
    assert sum("optimization pass" in line for line in stored) == 200
    assert EngineBuild.objects.filter(model__name="steady").count() == 1
    assert _build_containers(engine, build["id"]) == []


def test_the_build_page_follows_a_build_live_without_a_reload(
    build_stack: Stack, builder_image: str, tmp_path, page, screenshot
):
    """In the browser: the log keeps up with thousands of lines and can be searched,
    the phase moves, and the artifacts appear when it ends, all on one page load."""
    from playwright.sync_api import expect

    stack = build_stack
    _register(stack, tmp_path, "llama", {"rank_sleep_s": 2, "lines": 3000})
    model_url = f"{stack.web_url}/models/{_model_id(stack, 'llama')}/"
    page.goto(model_url)
    page.fill("input[name=username]", stack.user.username)
    page.fill("input[name=password]", "operator-pass")
    page.click("button[type=submit]")
    # The build form asks the server as it changes: a broken rule beside its field, then what would happen.
    form = page.locator("#build-form")
    form.locator("select[name=host]").select_option(stack.host_name)
    form.locator("select[name=image]").select_option(builder_image)
    form.locator("input[name=max_seq_len]").fill("100000")
    expect(form.locator("[data-error-for=max_seq_len]")).to_contain_text("max_position_embeddings")
    form.locator("input[name=max_seq_len]").fill("2048")
    for name, value in (("tp_size", "2"), ("workers", "2"), ("max_batch_size", "16")):
        form.locator(f"input[name={name}]").fill(value)
    expect(page.locator("#build-verdict")).to_contain_text("A new engine will be compiled")
    screenshot("model-build-form")
    form.locator("button[type=submit]").click()
    page.wait_for_url(f"{stack.web_url}/builds/*/")
    page.evaluate("window.loadedOnce = true")  # gone if the page reloads
    expect(page.locator("#build [data-status]")).to_have_text("succeeded", timeout=120_000)
    expect(page.locator("#artifacts")).to_contain_text("rank1.engine", timeout=10_000)
    assert page.evaluate("window.loadedOnce") is True
    log = page.locator("#build-log")
    page.wait_for_function("() => Number(document.getElementById('build-log').dataset.lines) >= 3000")
    page.fill("#log-search", "Engine generated for rank")
    page.wait_for_function("() => Number(document.getElementById('build-log').dataset.shown) === 2")
    expect(log).to_contain_text("Engine generated for rank 1")
    screenshot("build")
    # The same settings again: the form says the engine would be reused before anything is sent.
    page.goto(model_url)
    form.locator("select[name=host]").select_option(stack.host_name)
    form.locator("select[name=image]").select_option(builder_image)
    for name, value in (("tp_size", "2"), ("workers", "2"), ("max_batch_size", "16")):
        form.locator(f"input[name={name}]").fill(value)
    expect(page.locator("#build-verdict")).to_contain_text("will be reused")
    page.goto(f"{stack.web_url}/builds/?status=succeeded")
    expect(page.locator("#build-list")).to_contain_text("llama")
    screenshot("builds")
