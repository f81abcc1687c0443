"""Real processes for end-to-end tests: the web and live servers (as
controlplane.serving runs them) and a Celery
worker pinned to a fresh host queue, both on the test PostgreSQL database and
the test Redis. Everything started here is stopped by process id.

Over 450 lines on purpose: the stack's processes, ports, images and the
checkpoints the integration tests share are fixtures of one conftest, which
pytest finds by its name."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dj_database_url
import pytest
import redis
import requests
from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection

from access.services import token_create
from controlplane.celery import beat_argv, host_worker_argv
from controlplane.serving import live_argv, web_argv
from hosts import grants
from hosts.models import GpuHost, HostCredential
from hosts.services import host_join
from workers import channel, processes
from workers.loadtest.aiperf import KEY_ENV, Step, aiperf_executable, config_for
from workers.runtimes import process
from workers.runtimes.base import busy_ports

ROOT = Path(__file__).resolve().parents[2]


def _ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


# Ports handed out in this run, across the suite's processes: a lock file per port,
# held by the process it went to until that process exits.
PORT_LOCKS = Path(tempfile.gettempdir()) / "gantry-test-ports"
_held_ports: list = []


def free_ports(count: int = 1) -> int:
    """The first of ``count`` consecutive ports nothing listens on, below the
    ephemeral range: client sockets take ephemeral ports at any moment, so a
    server port picked there can be taken before the server binds it.

    Each is also reserved for this process until it exits: a port handed out
    but not bound yet (a deployment's Triton range) or free for a moment (a
    Redis a test restarts) is never handed to another test of the run."""
    low, _ = _ephemeral_range()
    for _ in range(200):
        base = random.randrange(10000, low - count)
        ports = list(range(base, base + count))
        if not busy_ports("127.0.0.1", ports) and _reserve(ports):
            return base
    raise RuntimeError(f"no {count} free consecutive ports below {low}")


def _reserve(ports: list[int]) -> bool:
    PORT_LOCKS.mkdir(exist_ok=True)
    taken = []
    for port in ports:
        handle = open(PORT_LOCKS / str(port), "a")  # noqa: SIM115 - held until this process exits
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            for other in taken:
                other.close()
            return False
        taken.append(handle)
    _held_ports.extend(taken)
    return True


def free_port() -> int:
    return free_ports(1)


def built_image(variable: str) -> str:
    """The tag of an image make test built, from ``variable``; the test fails
    (never skips) when it is not set."""
    tag = os.environ.get(variable, "")
    if not tag:
        pytest.fail(f"{variable} is not set: run the suite with make test, which builds the image")
    return tag


def spawned_database_url() -> str:
    """This test process's PostgreSQL database, for the servers and workers a test starts."""
    db = settings.DATABASES["default"]
    database_url = f"postgres://{db['USER']}:{db.get('PASSWORD') or ''}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    assert dj_database_url.parse(database_url)["NAME"].startswith("test_")
    return database_url


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.2):  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def stop_process(process: subprocess.Popen, timeout_s: float = 20) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@dataclass
class Stack:
    host_name: str
    web_url: str
    ws_url: str
    token: str
    user: User
    data_dir: Path
    env: dict[str, str]
    worker: subprocess.Popen
    log_dir: Path
    worker_argv: list[str] | None = None  # default: the product's host worker command
    worker_database_url: str = ""  # the host's own role (default: the control plane's, as env says)

    def session(self) -> requests.Session:
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {self.token}"
        return session

    def register_models(self, path: Path, **kinds: str) -> None:
        """Register the checkpoint at ``path`` on this stack's host once per name=kind,
        through the REST API, and wait until the host's worker has inspected it."""
        http = self.session()
        for name, kind in kinds.items():
            body = {"name": name, "kind": kind, "path": str(path), "host": self.host_name}
            response = http.post(f"{self.web_url}/api/models/", json=body, timeout=30)
            assert response.status_code == 201, response.text
            url = f"{self.web_url}/api/models/{response.json()['id']}/"
            wait_for(lambda url=url: http.get(url, timeout=10).json()["inspection"] == "ready", 60, f"{name} inspected")

    def start_worker(self) -> subprocess.Popen:
        argv = self.worker_argv or host_worker_argv(sys.executable, self.host_name)
        env = {**self.env, "DATABASE_URL": self.worker_database_url or self.env["DATABASE_URL"]}
        self.worker = _spawn([*argv, "--without-mingle", "--without-gossip"], env, self.log_dir / "worker.log")
        return self.worker


def _spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "ab")  # noqa: SIM115 - closed when the process ends
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@dataclass
class RedisServer:
    """A Redis of a test's own, to stop and start again under a running stack.
    It keeps nothing on disk: a restart loses what its queues held, as a Redis
    without persistence (or one that crashed) does."""

    port: int
    data_dir: Path
    process: subprocess.Popen | None = None
    bind: tuple[str, ...] = ("127.0.0.1",)
    password: str = ""  # the default user's; empty: none

    @property
    def url(self) -> str:
        return f"redis://{f':{self.password}@' if self.password else ''}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", *self.bind, "--save", "", "--appendonly", "no"]
        argv += ["--protected-mode", "no"]  # reached from the test's own network namespaces too
        argv += ["--requirepass", self.password] if self.password else []
        self.process = _spawn([*argv, "--dir", str(self.data_dir)], dict(os.environ), self.data_dir / "redis.log")
        wait_for(self._answers, 10, f"redis-server on port {self.port}")

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
            self.process = None

    def _answers(self) -> bool:
        client = redis.Redis(port=self.port, password=self.password or None, socket_connect_timeout=0.5, retry=None)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    data_dir = tmp_path / "redis"
    data_dir.mkdir()
    server = RedisServer(port=free_port(), data_dir=data_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def stack_on_own_redis(transactional_db, tmp_path: Path, operator: User, own_redis: RedisServer) -> Iterator[Stack]:  # noqa: ANN001
    """A stack whose Redis (broker and channel layer) the test may stop and start."""
    yield from make_stack(tmp_path, operator, extra_env={"REDIS_URL": own_redis.url})


@dataclass
class PostgresServer:
    """A PostgreSQL of a test's own (initdb in a temporary folder), to stop and
    start again under a running stack. As root, it runs as the postgres user."""

    port: int
    root: Path
    listen: tuple[str, ...] = ("127.0.0.1",)
    namespace_auth: str = "trust"  # how the test's network namespaces sign in (scram-sha-256: by password)

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/gantry"

    def _run(self, *argv: str) -> None:
        binary = next(Path("/usr/lib/postgresql").glob(f"*/bin/{argv[0]}"))
        as_owner = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run([*as_owner, str(binary), *argv[1:]], check=True, capture_output=True, timeout=60)

    def init(self) -> None:
        self.root.mkdir()
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
        self._run("initdb", "-D", str(self.root / "data"), "-U", "postgres", "--auth=trust", "--no-sync")
        with open(self.root / "data" / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all 10.77.0.0/16 {self.namespace_auth}\n")  # the test's own network namespaces
        self.start()
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "gantry")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses={','.join(self.listen)} -c fsync=off"
        self._run("pg_ctl", "-D", str(self.root / "data"), "-o", options, "-l", str(self.root / "log"), "-w", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "fast", "-w", "stop")


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    yield from run_postgres()


def run_postgres(listen: tuple[str, ...] = ("127.0.0.1",), namespace_auth: str = "trust") -> Iterator[PostgresServer]:
    # Not under tmp_path: pytest's folder is private to this user, and the server runs as postgres.
    parent = Path(tempfile.mkdtemp(prefix="gantry-test-pg-"))
    parent.chmod(0o755)
    server = PostgresServer(port=free_port(), root=parent / "cluster", listen=listen, namespace_auth=namespace_auth)
    server.init()
    try:
        yield server
    finally:
        try:
            server.stop()
        except subprocess.CalledProcessError:
            pass  # already stopped
        shutil.rmtree(parent, ignore_errors=True)


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def page():  # noqa: ANN201 - Playwright's Page
    # Playwright's sync API runs an event loop in this thread: tests make their
    # database calls in fixtures set up before this one, never while it runs.
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed (make test installs it)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            # The size the pages are made for (issue: usable at 1280x800).
            yield browser.new_page(viewport={"width": 1280, "height": 800})
        finally:
            browser.close()


SCREENSHOTS = ROOT / "var" / "screenshots"
AXE = ROOT / "node_modules" / "axe-core" / "axe.min.js"  # make frontend installs it (package.json)
_AUDIT = """async () => (await axe.run(document, {runOnly: {type: "tag", values: ["wcag2a", "wcag2aa"]}}))
  .violations.filter((v) => v.impact === "serious" || v.impact === "critical")
  .map((v) => ({rule: v.id, help: v.help, where: v.nodes.slice(0, 3).map((n) => n.target.join(" "))}))"""


def audit(page) -> list[dict]:  # noqa: ANN001 - Playwright's Page
    """axe-core's WCAG 2 A and AA rules on the page as it stands: the serious and critical violations."""
    if not page.evaluate("typeof axe !== 'undefined'"):
        page.add_script_tag(path=str(AXE))
    return page.evaluate(_AUDIT)


@pytest.fixture
def screenshot(page):  # noqa: ANN001, ANN201
    """``screenshot(name)``: the whole page as the user sees it now, kept under
    var/screenshots/ (git-ignored) to look at after the run; and audited for
    accessibility (axe-core), which must find nothing serious."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    def take(name: str) -> Path:
        path = SCREENSHOTS / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        found = audit(page)
        assert not found, f"{name}: {found}"
        return path

    return take


@pytest.fixture(scope="session")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained Llama with a real tokenizer, made once per run (workers/untrained.py)."""
    from workers.untrained import make_untrained_llm

    return make_untrained_llm(tmp_path_factory.mktemp("llm") / "tiny-llama")


@pytest.fixture
def stack(request: pytest.FixtureRequest, transactional_db, tmp_path: Path, operator: User) -> Iterator[Stack]:  # noqa: ANN001
    """The web and live servers + a Celery worker for a fresh host name, sharing the test database;
    the beat too where the test is marked ``control_beat``."""
    yield from make_stack(tmp_path, operator, beat=request.node.get_closest_marker("control_beat") is not None)


def make_stack(
    tmp_path: Path,
    operator: User,
    *,
    extra_env: dict[str, str] | None = None,
    worker_argv: list[str] | None = None,
    beat: bool = False,
) -> Iterator[Stack]:
    """A Stack; with ``beat``, the control plane's periodic work runs beside it
    (controlplane.celery.beat_argv: host sweeps, run reaping, key revocation)."""
    database_url = spawned_database_url()
    host_name = f"e2e-{uuid.uuid4().hex[:8]}"
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    triton_base = free_ports(30)
    # The worker reads and writes the database as a joined host does: with its own role,
    # under the row policies of deployments.grants. (Its Redis user stays the control
    # plane's here, so its live messages need no beat; the fleet's hosts use their own.)
    joined = host_join.host_join(
        token=host_join.host_join_token_create(user=None, host_name=host_name).secret,
        name=host_name, address="127.0.0.1", gateway_url="",
    )  # fmt: skip
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "GANTRY_HOST_NAME": host_name,
        "GANTRY_DATA_DIR": str(data_dir),
        "GANTRY_HEARTBEAT_INTERVAL": "1",
        "GANTRY_TRITON_READY_TIMEOUT": "180",
        # Triton ports for this test's deployments start at a port the OS just found free.
        "GANTRY_TRITON_PORT_RANGE": f"{triton_base}-{triton_base + 29}",
        "PYTHONUNBUFFERED": "1",
        # The locally built Triton image the docker runtime may start (make test builds it).
        "GANTRY_ALLOWED_IMAGES": os.environ.get("GANTRY_TEST_TRITON_IMAGE", ""),
        # This sandbox forbids raising RLIMIT_MEMLOCK; keep NVIDIA's stack size.
        "GANTRY_DOCKER_ULIMITS": "stack=67108864:67108864",
        **(extra_env or {}),
    }
    settings.GANTRY_TRITON_PORT_RANGE = (triton_base, triton_base + 29)
    web_port, live_port = free_port(), free_port()
    env["GANTRY_LIVE_PORT"] = str(live_port)
    # The worker's load tests go through this stack's gateway, with the AIPerf make test installs.
    env["GANTRY_GATEWAY_URL"] = f"http://127.0.0.1:{web_port}"
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    # As the product runs: the web server (gunicorn, two processes) and the live server.
    web = _spawn(web_argv(sys.executable, bind="127.0.0.1", port=web_port, workers=2), env, log_dir / "web.log")
    live = _spawn(live_argv(sys.executable, bind="127.0.0.1", port=live_port), env, log_dir / "live.log")
    beater = _spawn(beat_argv(sys.executable, tmp_path / "beat-schedule"), env, log_dir / "beat.log") if beat else None
    token = token_create(user=operator, name="tests").secret
    result = Stack(
        host_name=host_name,
        web_url=f"http://127.0.0.1:{web_port}",
        ws_url=f"ws://127.0.0.1:{live_port}",
        token=token,
        user=operator,
        data_dir=data_dir,
        env=env,
        worker=None,  # type: ignore[arg-type]
        log_dir=log_dir,
        worker_argv=[a.replace("{host}", host_name) for a in worker_argv] if worker_argv else None,
        worker_database_url=joined.database_url,
    )
    result.start_worker()
    try:
        wait_for(lambda: healthz_answers(result.web_url), 30, "the web server")
        wait_for(lambda: _live_answers(live_port), 30, "the live server")
        beat = GpuHost.objects.filter(name=host_name, last_heartbeat__isnull=False)
        wait_for(beat.exists, 60, "the worker's first heartbeat")
        yield result
    finally:
        stop_process(result.worker)
        stop_process(web)
        stop_process(live)
        if beater is not None:
            stop_process(beater)
        # Whatever a failed test left serving: stop it by process id.
        for handle, repository in process.servers_under(data_dir):
            process.stop(handle, repository)
        channel.stop_under(data_dir)
        # Let PostgreSQL notice the stopped processes' sessions end, so the
        # test database can be flushed and dropped.
        wait_for(lambda: _other_sessions() == 0, 15, "the stopped processes' database sessions to close")
        for credential in HostCredential.objects.filter(host__name=host_name):  # roles outlive the database's rows
            grants.database_role_drop(credential.database_role)
            grants.redis_user_remove(credential.redis_user)
        for log in sorted(log_dir.iterdir()):
            tail = log.read_text(errors="replace").splitlines()[-40:]
            sys.stderr.write(f"--- {log.name} (last lines) ---\n" + "\n".join(tail) + "\n")


def _other_sessions() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0]


def _live_answers(port: int) -> bool:
    return bool(busy_ports("127.0.0.1", [port]))


def healthz_answers(base: str) -> bool:
    try:
        return requests.get(f"{base}/healthz", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def manage(env: dict[str, str], *argv: str) -> str:
    """Run ``manage.py argv`` as a separate process with ``env``; its output."""
    return subprocess.run(
        [sys.executable, "manage.py", *argv], cwd=ROOT, env=env, check=True, capture_output=True, text=True
    ).stdout


def bootstrap(env: dict[str, str], username: str = "ops") -> str:
    """Migrate the database ``env`` names and make an admin there; their API token."""
    manage(env, "migrate", "--noinput")
    manage({**env, "DJANGO_SUPERUSER_PASSWORD": f"{username}-pass"}, "createsuperuser", "--noinput",
           "--username", username, "--email", f"{username}@localhost")  # fmt: skip
    return manage(env, "gantry_token", username).strip()


def clean_up(data_dirs: list[Path], logs: Path) -> None:
    """Stop what a test left serving under ``data_dirs`` (by process id), and show its processes' last lines."""
    for data_dir in data_dirs:
        for handle, repository in process.servers_under(data_dir):
            process.stop(handle, repository)
        channel.stop_under(data_dir)
    for log in sorted(logs.iterdir()):
        sys.stderr.write(f"--- {log.name} (last lines) ---\n" + log.read_text(errors="replace")[-3000:] + "\n")


@dataclass
class Namespace:
    name: str
    address: str  # the host's own address, inside the namespace
    gateway: str  # this machine's end of the veth pair: where PostgreSQL and Redis answer


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=30)


@contextmanager
def namespaces(count: int) -> Iterator[list[Namespace]]:
    if os.geteuid() != 0:
        pytest.fail("network namespaces need root (make test runs as root, as CI does)")
    tag = uuid.uuid4().hex[:6]
    subnet = random.randrange(1, 60) * 4
    made: list[Namespace] = []
    try:
        for n in range(count):
            name, outside, inside = f"gantry-{tag}-{n}", f"gv{tag}{n}o", f"gv{tag}{n}i"
            gateway, address = f"10.77.{subnet + n}.1", f"10.77.{subnet + n}.2"
            _ip("netns", "add", name)
            made.append(Namespace(name, address, gateway))
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", name)
            _ip("addr", "add", f"{gateway}/30", "dev", outside)
            _ip("link", "set", outside, "up")
            _ip("-n", name, "addr", "add", f"{address}/30", "dev", inside)
            _ip("-n", name, "link", "set", inside, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield made
    finally:
        for namespace in made:  # its end of the veth pair goes with it, and so does ours
            subprocess.run(["ip", "netns", "del", namespace.name], capture_output=True, timeout=30)


@dataclass
class Fleet:
    """A control plane on this machine (PostgreSQL, Redis, web, live, beat) and
    GPU-host workers, each in a network namespace of its own (reaching the
    database and Redis over a veth pair, as another machine would)."""

    base: str
    token: str
    hosts: dict[str, Namespace]
    control_env: dict[str, str]
    host_env: Any  # (name) -> the environment of that host's worker
    logs: Path
    spawned: list[subprocess.Popen]
    workers: dict[str, subprocess.Popen]

    def session(self) -> requests.Session:
        http = requests.Session()
        http.headers["Authorization"] = f"Bearer {self.token}"
        return http

    def get(self, path: str) -> dict:
        return self.session().get(f"{self.base}{path}", timeout=10).json()

    def register(self, name: str, kind: str, path: Path, host: str) -> None:
        """Register the checkpoint at ``path`` on ``host`` through the REST API; wait
        until that host has inspected it and every host's agent has found it on its
        disk (the hosts share this machine's files) and recorded its copy, which
        placement needs."""
        body = {"name": name, "kind": kind, "path": str(path), "host": host}
        created = self.session().post(f"{self.base}/api/models/", json=body, timeout=30)
        assert created.status_code == 201, created.text
        row = lambda: self.get(f"/api/models/{created.json()['id']}/")  # noqa: E731
        wait_for(lambda: row()["inspection"] == "ready", 60, f"the inspection of {name}")
        held = lambda: {copy["host"] for copy in row()["copies"] if copy["matches"]}  # noqa: E731
        wait_for(lambda: held() == set(self.hosts), 60, f"every host's copy of {name}")

    def start_worker(self, name: str) -> subprocess.Popen:
        argv = ["ip", "netns", "exec", self.hosts[name].name, *host_worker_argv(sys.executable, name)]
        worker = _spawn(argv, self.host_env(name), self.logs / f"worker-{name}.log")
        self.spawned.append(worker)
        self.workers[name] = worker
        return worker


@contextmanager
def fleet(
    tmp_path: Path,
    count: int,
    extra_env: dict[str, str] | None = None,
    per_host: dict[str, dict[str, str]] | None = None,
) -> Iterator[Fleet]:
    """A Fleet of ``count`` hosts (host-a, host-b, ...), every one beating; stopped
    and cleaned up (by process id) on the way out. ``per_host``: a host's own
    settings beside ``extra_env`` (its addresses on 127.0.0.1 read as its end of
    the veth pair, as for GANTRY_HUB_ENDPOINT)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    spawned: list[subprocess.Popen] = []
    names = [f"host-{chr(ord('a') + n)}" for n in range(count)]
    with namespaces(count) as made:
        hosts = dict(zip(names, made, strict=True))
        gateways = tuple(ns.gateway for ns in made)
        postgres_runner = run_postgres(listen=("127.0.0.1", *gateways))
        postgres = next(postgres_runner)
        redis_dir = tmp_path / "redis"
        redis_dir.mkdir()
        redis = RedisServer(port=free_port(), data_dir=redis_dir, bind=("127.0.0.1", *gateways))
        redis.start()
        triton = free_ports(30)
        base_env = {
            **os.environ,
            "GANTRY_HEARTBEAT_INTERVAL": "1",
            "GANTRY_TRITON_PORT_RANGE": f"{triton}-{triton + 29}",  # the same ports on every host
            "PYTHONUNBUFFERED": "1",
            **(extra_env or {}),
        }
        control_env = {**base_env, "DATABASE_URL": postgres.url, "REDIS_URL": redis.url}

        joined: dict[str, dict[str, str]] = {}

        def host_env(name: str) -> dict[str, str]:
            # Each host works with the credentials it joined with (hosts.grants).
            ns = hosts[name]
            return {
                **base_env,
                "DATABASE_URL": joined[name]["database_url"].replace("127.0.0.1", ns.gateway),
                "REDIS_URL": joined[name]["redis_url"].replace("127.0.0.1", ns.gateway),
                "GANTRY_JOINED_HOST": "1",
                "GANTRY_HOST_NAME": name,
                "GANTRY_HOST_ADDRESS": ns.address,
                "GANTRY_DATA_DIR": str(tmp_path / name),
                # A hub stand-in on this machine answers each host at its end of the veth pair.
                "GANTRY_HUB_ENDPOINT": base_env.get("GANTRY_HUB_ENDPOINT", "").replace("127.0.0.1", ns.gateway),
                **{k: v.replace("127.0.0.1", ns.gateway) for k, v in (per_host or {}).get(name, {}).items()},
            }

        try:
            token = bootstrap(control_env)
            web_port, live_port = free_port(), free_port()
            control_env["GANTRY_LIVE_PORT"] = str(live_port)
            spawned.append(_spawn(web_argv(sys.executable, bind="127.0.0.1", port=web_port, workers=1), control_env,
                                  logs / "web.log"))  # fmt: skip
            spawned.append(_spawn(live_argv(sys.executable, bind="127.0.0.1", port=live_port), control_env,
                                  logs / "live.log"))  # fmt: skip
            beat = beat_argv(sys.executable, tmp_path / "beat-schedule")
            spawned.append(_spawn(beat, control_env, logs / "beat.log"))
            result = Fleet(base=f"http://127.0.0.1:{web_port}", token=token, hosts=hosts, control_env=control_env,
                           host_env=host_env, logs=logs, spawned=spawned, workers={})  # fmt: skip
            wait_for(lambda: healthz_answers(result.base), 30, "the web server")
            http = result.session()
            for name, ns in hosts.items():
                made = http.post(f"{result.base}/api/hosts/join-tokens/", json={"host": name}, timeout=30).json()
                body = {"token": made["token"], "name": name, "address": ns.address}
                joined[name] = http.post(f"{result.base}/api/hosts/join/", json=body, timeout=60).json()
                result.start_worker(name)
            online = lambda: {h["name"] for h in result.get("/api/hosts/")["results"] if h["is_online"]}  # noqa: E731
            wait_for(lambda: online() >= set(hosts), 60, "every host's first beat")
            yield result
        finally:
            for child in reversed(spawned):
                stop_process(child)
            clean_up([tmp_path / name for name in hosts], logs)
            redis.stop()
            next(postgres_runner, None)  # stops and removes it


def start_aiperf(
    folder: Path, *, base: str, key: str, tokenizer: Path, kind: str, alias: str, workload: dict[str, Any]
) -> subprocess.Popen:
    """AIPerf through the gateway at ``base`` on ``alias``, configured as a Gantry
    load test of ``workload`` (loadtests.workload's rules) would be; its own
    process group, its records under ``folder``/artifacts."""
    from loadtests import workload as workloads
    from loadtests.models import LoadTest

    folder.mkdir()
    checked = workloads.check(kind, workload)
    run = LoadTest(kind=kind, alias=alias, triton_name=alias, workload=checked)
    step = Step(target="gateway", level=checked["levels"][0], index=0, total=1)
    config = config_for(run, step, gateway_url=base, triton_url="", tokenizer=str(tokenizer),
                        artifacts=folder / "artifacts")  # fmt: skip
    (folder / "aiperf.json").write_text(json.dumps(config))
    env = processes.child_environment({KEY_ENV: key, "HF_HUB_DISABLE_TELEMETRY": "1"})
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)
    argv = [str(aiperf_executable()), "profile", "--config", str(folder / "aiperf.json"), "--ui", "none",
            "--no-gpu-telemetry", "--no-server-metrics"]  # fmt: skip
    with (folder / "aiperf.log").open("wb") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # noqa: S603


@contextmanager
def forwarded(listen: tuple[str, int], to: tuple[str, int]) -> Iterator[None]:
    """Forward TCP connections made to ``listen`` (e.g. a host's end of its veth
    pair) to ``to`` on this machine, as a network path between two machines would."""
    import socket
    import threading

    def pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def accept(server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
                upstream = socket.create_connection(to)
            except OSError:
                return
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    server = socket.create_server(listen)
    threading.Thread(target=accept, args=(server,), daemon=True).start()
    try:
        yield
    finally:
        server.close()
