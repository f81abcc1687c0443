"""The admin secret reaches tritonserver without its command line.

tritonserver takes its restricted-API rule only as an argument, where every
local user can read it (/proc/PID/cmdline, ps) and anyone who inspects its
container. Gantry puts a token there instead and writes the rule to a file
only the agent's user can read; a small library Gantry compiles on the host
(argv_secret.c, loaded with LD_PRELOAD) puts the rule in place of the token
inside the process, before tritonserver reads its arguments. Without the
library tritonserver refuses the token as a malformed rule: it never starts
unprotected.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from common.errors import PermanentError
from common.once import make_once
from triton_server.client import ADMIN_HEADER

TOKEN = "@gantry-admin-rule@"  # GANTRY_SECRET_TOKEN in argv_secret.c
LIBRARY_PREFIX = "gantry-argv-secret"  # GANTRY_LIBRARY_PREFIX in argv_secret.c
SOURCE = Path(__file__).with_name("argv_secret.c")
RULE_FILE = "admin-rule"


def restricted_api_args(secret: str) -> list[str]:
    """The model-repository and logging APIs restricted to ``secret``, by token."""
    if not secret:
        return []
    return [f"--http-restricted-api={TOKEN}", f"--grpc-restricted-protocol={TOKEN}"]


def rule(secret: str) -> str:
    return f"model-repository,logging:{ADMIN_HEADER}={secret}"


def write_rule(folder: Path, secret: str) -> Path:
    """The rule file in a deployment's ``folder``: mode 0600, the agent's own."""
    path = folder / RULE_FILE
    partial = folder / f".{RULE_FILE}.partial"
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        os.fchmod(descriptor, 0o600)  # an older file's looser mode does not carry over
        handle.write(rule(secret) + "\n")
    os.replace(partial, path)
    return path


def library(data_dir: Path) -> Path:
    """argv_secret.c compiled for this host, once per version of its source; a
    copy built beside the source (Gantry's image builds one: it has no
    compiler) is used as it is."""
    name = f"{LIBRARY_PREFIX}-{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]}.so"
    if SOURCE.with_name(name).exists():
        return SOURCE.with_name(name)
    target = data_dir / "triton" / name

    def make() -> None:
        compiler = shutil.which(os.environ.get("CC") or "cc")
        if compiler is None:
            raise PermanentError(
                "no C compiler (cc) on this host: Gantry compiles a small library that keeps Triton's admin "
                "secret off tritonserver's command line; install one (Debian, Ubuntu: apt-get install gcc)"
            )
        partial = target.with_suffix(".partial")
        built = subprocess.run(  # noqa: S603 - a fixed compiler command on Gantry's own source
            [compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(SOURCE), "-ldl"],
            capture_output=True,
            text=True,
            check=False,
        )
        if built.returncode != 0:
            raise PermanentError(f"could not compile {SOURCE.name} with {compiler}: {built.stderr.strip()[-2000:]}")
        os.replace(partial, target)

    make_once(target.parent, target.exists, make)
    return target


@dataclass(frozen=True)
class SecretFiles:
    """The library and the rule file one server start reads."""

    library: Path
    rule: Path

    def environment(self, preload: str = "") -> dict[str, str]:
        """The server's LD_PRELOAD (this library first, then ``preload``) and rule file."""
        return {
            "LD_PRELOAD": f"{self.library}:{preload}" if preload else str(self.library),
            "GANTRY_SECRET_FILE": str(self.rule),
        }


def prepare(secret: str, folder: Path, data_dir: Path) -> SecretFiles | None:
    """The library built and the rule written in a deployment's ``folder``;
    None for a server with no secret (its admin APIs are not restricted)."""
    if not secret:
        return None
    return SecretFiles(library=library(data_dir), rule=write_rule(folder, secret))
