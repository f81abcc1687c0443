"""`gantry join URL TOKEN`: a GPU host joins the control plane in one step.

It trades the join token (made by an admin: ``gantry join-token`` or
``POST /api/hosts/join-tokens/``) for a database role and a Redis user of its
own, writes them with the host's settings to an environment file (mode 0600),
installs what it can (``gantry check --install``), writes the systemd unit and
starts it. Nothing here needs Django's settings: the host has none before it
joins.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

ENV_FILE_NAME = "gantry.env"


class JoinRefused(Exception):
    """The control plane refused the join, or could not be reached; the message says why."""


def plain_http_refusal(url: str) -> str:
    """Why joining over ``url`` is refused, or "": the token goes out and the
    host's database and Redis passwords come back, so plain HTTP is only for
    this machine itself unless the admin says the network is trusted."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "https":
        return ""
    if parts.scheme != "http" or not parts.hostname:
        return f"{url}: the control plane's address must be an https:// (or http://) URL"
    if parts.hostname in ("localhost", "127.0.0.1", "::1") or parts.hostname.startswith("127."):
        return ""
    return (
        f"{url} is plain HTTP: the join token and this host's database and Redis passwords would cross the "
        "network in clear; use https://, or --allow-http on a network you trust"
    )


def request_join(
    url: str, token: str, *, name: str, address: str, certificate_request: str = "", timeout_s: float = 30
) -> dict:
    """POST the token (and the channel's certificate request) to
    ``<url>/api/hosts/join/``; the control plane's answer."""
    body = {"token": token, "name": name, "address": address, "certificate_request": certificate_request}
    body = json.dumps(body).encode()
    request = urllib.request.Request(
        f"{url.rstrip('/')}/api/hosts/join/",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "Accept": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - the admin's URL
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read()).get("detail", "")
        except (ValueError, AttributeError):
            detail = ""
        raise JoinRefused(f"the control plane refused (HTTP {exc.code}): {detail or exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise JoinRefused(f"cannot reach the control plane at {url}: {getattr(exc, 'reason', exc)}") from None


def env_lines(joined: dict, *, name: str, address: str, data_dir: Path, model_roots: str) -> dict[str, str]:
    """The host's settings: its own credentials and secret key, its name and
    address, and the settings it shares with the control plane."""
    values = {
        "GANTRY_HOST_NAME": name,
        "GANTRY_HOST_ADDRESS": address,
        "DATABASE_URL": joined["database_url"],
        "REDIS_URL": joined["redis_url"],
        # Its own: the control plane's key never leaves it, and a worker signs nothing.
        "SECRET_KEY": secrets.token_urlsafe(48),
        "GANTRY_DATA_DIR": str(data_dir),
        "GANTRY_MODEL_ROOTS": model_roots or str(data_dir / "models"),
    }
    values.update({key: value for key, value in joined.get("settings", {}).items() if value})
    for key, value in values.items():
        if any(c.isspace() for c in value) or '"' in value or "\\" in value:
            raise JoinRefused(f"{key}: {value!r} cannot be written to an environment file (spaces or quotes)")
    return values


def write_env_file(path: Path, values: dict[str, str]) -> None:
    """KEY=value lines, as systemd's EnvironmentFile reads them; mode 0600 from
    the start (the file holds passwords), replaced in one rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = f"# Written by gantry join at {stamp}: this host's own credentials. Keep it private.\n"
    text += "".join(f"{key}={value}\n" for key, value in values.items())
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(partial, path)


def channel_key(name: str) -> tuple[str, str]:
    """A new key for the host's channel (PEM) and its certificate request."""
    from common import pki

    key = pki.new_key()
    return pki.key_pem(key), pki.request(key, name)


def write_channel(data_dir: Path, key: str, joined: dict) -> None:
    """The channel's key, the certificate the control plane signed and its trust,
    where the channel reads them (workers.channel; folder 0700, files 0600)."""
    from workers.channel import install

    if not joined.get("certificate"):
        return
    place = data_dir / "channel"
    place.mkdir(parents=True, exist_ok=True, mode=0o700)
    install(place, key=key, certificate=joined["certificate"], trust=joined["trust"])


def prepare_data_dir(path: Path, user: str) -> None:
    """The data folder (its models/ and channel/), owned by the worker's user when run as root."""
    (path / "models").mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return
    import pwd

    try:
        owner = pwd.getpwnam(user)
    except KeyError:
        return  # the unit names a user that does not exist yet; systemd will say so
    channel = path / "channel"
    owned = [path, path / "models", *([channel, *channel.iterdir()] if channel.is_dir() else [])]
    for item in owned:
        os.chown(item, owner.pw_uid, owner.pw_gid)


def model_user_ensure(name: str) -> dict[str, str]:
    """The user model code will run as (workers.model_user), made when missing:
    a system user with no login, no home and no other group. Its setting; none
    for an empty name."""
    if not name:
        return {}
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        if os.geteuid() != 0:
            raise JoinRefused(
                f"--model-user {name}: there is no such user and only root may make it "
                "(run gantry join as root, or pass --model-user '' to run model code as the worker)"
            ) from None
        made = subprocess.run(
            ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
             "--shell", "/usr/sbin/nologin", name],
            capture_output=True, text=True,
        )  # fmt: skip
        if made.returncode != 0:
            raise JoinRefused(f"--model-user {name}: useradd failed: {made.stderr.strip()}") from None
    return {"GANTRY_MODEL_USER": name}


def read_env_file(path: Path) -> dict[str, str]:
    """The KEY=value lines of an environment file (comments and blank lines skipped)."""
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            values[key.strip()] = value.strip()
    return values


def default_address() -> str:
    """This host's address on the route to the outside (where clients would reach it)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, it only picks the route
        return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


def check_and_install(env_file: Path) -> int:
    """``gantry check --install`` under the new settings (and the allow-listed
    part of this environment: nothing else join was started with); its exit code."""
    from workers.processes import child_environment

    env = child_environment(read_env_file(env_file))
    return subprocess.run([sys.executable, "-m", "controlplane.cli", "check", "--install"], env=env).returncode


def start_unit(unit_path: Path) -> str:
    """Enable and start the unit when systemd runs here; otherwise say how."""
    unit = unit_path.name
    if shutil.which("systemctl") is None or not Path("/run/systemd/system").is_dir():
        return f"systemd is not running here: start the worker with `gantry worker` and its settings from {unit_path}"
    for argv in (["systemctl", "daemon-reload"], ["systemctl", "enable", "--now", unit]):
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            return f"{' '.join(argv)} failed: {done.stderr.strip()}"
    return f"started {unit}: systemctl status {unit}, journalctl -u {unit}"
