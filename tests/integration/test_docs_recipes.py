"""Every recipe in README.md and docs/ runs as written: `make demo` from a
fresh shell, then each page's sh and python blocks, in order, in a fresh
shell of their own (``bash -euo pipefail``) that has only what a reader's
has. The one change made to a block is the demo's port (this test's, not
8000). A block that is not run says why (tests/recipes.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.integration.conftest import free_ports, healthz_answers, stop_process, wait_for
from tests.recipes import PAGES, ROOT, script

pytestmark = [pytest.mark.integration]

PYTHON = ROOT / ".venv" / "bin" / "python"


def test_every_recipe_in_the_readme_and_the_manual_runs_as_written(tmp_path: Path):
    web = free_ports(3)  # the demo takes web, web + 1 (live) and web + 2 (its Redis)
    fresh = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    fresh["GANTRY_DATA_DIR"] = str(tmp_path / "var")  # where make demo keeps everything: a new one
    log = open(tmp_path / "demo.log", "wb")  # noqa: SIM115 - closed below
    demo = subprocess.Popen(
        ["bash", "-c", "make demo"], cwd=ROOT, env={**fresh, "GANTRY_WEB_PORT": str(web)},
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{web}"
    try:
        wait_for(lambda: healthz_answers(base) or demo.poll() is not None, 240, "make demo")
        assert demo.poll() is None, (tmp_path / "demo.log").read_text()[-3000:]
        token = subprocess.run(
            [str(ROOT / ".venv" / "bin" / "gantry"), "token", "admin", "--name", "docs-test"],
            env=fresh, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        http = requests.Session()
        http.headers["Authorization"] = f"Bearer {token}"
        shown = lambda: http.get(f"{base}/api/deployments/1/", timeout=10).json().get("shown_status")  # noqa: E731
        wait_for(lambda: shown() == "ready", 300, "the demo's stack")

        key_file = tmp_path / "key"
        ran = {}
        for page in PAGES:
            code = script(page, web, PYTHON)
            if not code:
                continue
            if page.name == "README.md":  # its recipe makes the gateway key the other pages' readers export
                code += f'printf %s "$GANTRY_API_KEY" > {key_file}\n'
            env = {**fresh, **({"GANTRY_API_KEY": key_file.read_text()} if key_file.exists() else {})}
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                timeout=300,
            )  # fmt: skip
            assert done.returncode == 0, f"{page.name}:\n{code}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
            ran[page.name] = done.stdout
        assert set(ran) >= {"README.md", "api.md", "gateway.md", "load-tests.md"}
        assert "CompletionUsage" in ran["README.md"]  # the openai client got an answer and its usage
        assert "data: " in ran["api.md"]  # the generate action streamed
        assert '"relevance_score"' in ran["gateway.md"]
        assert '"status":"queued"' in ran["load-tests.md"].replace(" ", "")
        minilm = http.get(f"{base}/api/deployments/?name=minilm", timeout=10).json()["results"]
        assert [d["desired_state"] for d in minilm] == ["running"]  # the README's own deployment was started
        ports = {r["http_port"] for r in minilm[0]["replica_set"]}
        assert len(ports) >= 2  # two replicas (or more, scaled already), each its own Triton

        # README's autoscale recipe does what it says: under load through its
        # alias, the demo's periodic work adds a replica. The load starts once both
        # replicas are ready (the recipe waited for one).
        mine = lambda: http.get(f"{base}/api/deployments/{minilm[0]['id']}/", timeout=10).json()  # noqa: E731
        wait_for(lambda: mine()["shown_status"] == "ready", 300, "minilm's two replicas")
        _answered_in_a_row(base, key_file.read_text(), 10)
        _load_until_scaled(base, key_file.read_text(), http, minilm[0]["id"])
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGINT)  # Ctrl-C, as the README says
            try:
                demo.wait(timeout=60)
            except subprocess.TimeoutExpired:
                stop_process(demo)
        log.close()


def _answered_in_a_row(base: str, key: str, count: int, timeout_s: float = 120) -> None:
    """The alias answers ``count`` requests in a row, each on a new connection (so on
    any of the demo's web processes): each process's cached route, read while the
    deployment loaded, has been read again since (on a busy machine a slow read keeps
    serving the old one a while, as it would through a database outage)."""
    deadline, answered = time.monotonic() + timeout_s, 0
    while answered < count:
        assert time.monotonic() < deadline, f"the minilm alias did not answer {count} requests in a row"
        body = {"model": "minilm", "input": ["a cat"]}
        ok = requests.post(f"{base}/v1/embeddings", json=body, headers={"Authorization": f"Bearer {key}"},
                           timeout=30).status_code == 200  # fmt: skip
        answered = answered + 1 if ok else 0
        if not ok:
            time.sleep(1)


def _load_until_scaled(base: str, key: str, http: requests.Session, deployment_id: int, timeout_s: float = 240) -> None:
    """Embeddings through the "minilm" alias from 16 clients (4 per replica is
    the recipe's target) until the deployment has grown past its 2 replicas."""
    stop = threading.Event()
    answered: list[int] = []
    refusals: dict[str, int] = {}  # each refusal's message, counted: the failure says why

    def client() -> None:
        with requests.Session() as session:
            session.headers["Authorization"] = f"Bearer {key}"
            while not stop.is_set():
                body = {"model": "minilm", "input": ["a cat sat on the mat " * 20] * 8}
                answer = session.post(f"{base}/v1/embeddings", json=body, timeout=60)
                answered.append(answer.status_code)
                if answer.status_code != 200:
                    message = f"{answer.status_code} {answer.text[:300]}"
                    refusals[message] = refusals.get(message, 0) + 1

    threads = [threading.Thread(target=client, daemon=True) for _ in range(16)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            deployment = http.get(f"{base}/api/deployments/{deployment_id}/", timeout=10).json()
            if deployment["replicas"] > 2:
                break
            time.sleep(2)
        else:
            timeline = http.get(f"{base}/api/events/?deployment={deployment_id}&limit=20", timeout=10).json()
            raise AssertionError(f"no scale-up in {timeout_s:.0f} s: {[e['message'] for e in timeline['results']]}")
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=70)
    assert answered.count(200) >= len(answered) * 0.9, f"{len(answered)} answers; refusals: {refusals}"
