"""Every recipe in README.md and docs/ runs as written: `make demo` from a
fresh shell, then each page's sh and python blocks, in order, in a fresh
shell of their own (``bash -euo pipefail``) that has only what a reader's
has. The one change made to a block is the demo's port (this test's, not
8000). A block that is not run says why (tests/recipes.py)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import requests

from tests.integration.conftest import free_ports, healthz_answers, stop_process, wait_for
from tests.recipes import LANGUAGES, PAGES, ROOT, blocks

pytestmark = [pytest.mark.integration]

PYTHON = ROOT / ".venv" / "bin" / "python"


def _script(page: Path, port: int) -> str:
    """The page's runnable blocks as one shell script; python blocks are fed to the venv's python."""
    parts = []
    for block in blocks(page):
        if block.language not in LANGUAGES or block.not_run:
            continue
        code = block.code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        if block.language == "python":
            code = f"{PYTHON} - <<'GANTRY_RECIPE_PY'\n{code}GANTRY_RECIPE_PY\n"
        parts.append(f"# {block.where}\n{code}")
    return "".join(parts)


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
            script = _script(page, web)
            if not script:
                continue
            if page.name == "README.md":  # its recipe makes the gateway key the other pages' readers export
                script += f'printf %s "$GANTRY_API_KEY" > {key_file}\n'
            env = {**fresh, **({"GANTRY_API_KEY": key_file.read_text()} if key_file.exists() else {})}
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                timeout=300,
            )  # fmt: skip
            assert done.returncode == 0, f"{page.name}:\n{script}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
            ran[page.name] = done.stdout
        assert set(ran) >= {"README.md", "api.md", "gateway.md", "load-tests.md"}
        assert "CompletionUsage" in ran["README.md"]  # the openai client got an answer and its usage
        assert "data: " in ran["api.md"]  # the generate action streamed
        assert '"relevance_score"' in ran["gateway.md"]
        assert '"status":"queued"' in ran["load-tests.md"].replace(" ", "")
        minilm = http.get(f"{base}/api/deployments/?name=minilm", timeout=10).json()["results"]
        assert [d["desired_state"] for d in minilm] == ["running"]  # the README's own deployment was started
        ports = {r["http_port"] for r in minilm[0]["replica_set"]}
        assert len(ports) == 2  # two replicas, each its own Triton
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGINT)  # Ctrl-C, as the README says
            try:
                demo.wait(timeout=60)
            except subprocess.TimeoutExpired:
                stop_process(demo)
        log.close()
