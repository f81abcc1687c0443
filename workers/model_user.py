"""Model code runs as a user of its own, not as the worker.

A registration may allow a checkpoint's own Python code (``trust_remote_code``);
that code runs inside tritonserver's python stubs. Run as the worker's user it
could read the worker's environment (the host's database and Redis passwords),
its settings file, the channel's private key and whatever the Docker socket
gives. Under ``GANTRY_MODEL_USER`` tritonserver starts through ``setpriv`` as
that user: no supplementary groups (so not ``docker``), no capabilities, no
new privileges. Its own folder (``own_folder``) is the only place it writes;
the checkpoint and the repository are the worker's, readable and not writable.

Switching users takes root or, for a worker that runs as its own user (the unit
``gantry join`` writes), CAP_SETUID and CAP_SETGID to switch, CAP_CHOWN to give
the model its folder and CAP_KILL to stop what runs as that user.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from pathlib import Path

from django.conf import settings

from common.errors import PermanentError

# The model's own folder, beside the repository it serves.
FOLDER_NAME = "model-home"
# The capabilities a worker that is not root needs (capabilities(7) numbers).
NEEDED_CAPABILITIES = {"CAP_CHOWN": 0, "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7}


def model_user() -> pwd.struct_passwd | None:
    """The user model code runs as (``GANTRY_MODEL_USER``); None when unset."""
    name = settings.GANTRY_MODEL_USER
    if not name:
        return None
    try:
        user = pwd.getpwnam(name)
    except KeyError:
        raise PermanentError(
            f"GANTRY_MODEL_USER: there is no user {name!r} on this host "
            f"(useradd --system --shell /usr/sbin/nologin {name}, or gantry join makes it)"
        ) from None
    if user.pw_uid == 0 or user.pw_uid == os.geteuid():
        raise PermanentError(
            f"GANTRY_MODEL_USER: {name!r} is {'root' if user.pw_uid == 0 else 'the worker’s own user'}; "
            "model code would hold the worker's secrets: name a user of its own"
        )
    return user


def missing_capabilities() -> list[str]:
    """The capabilities this process lacks to run model code as another user."""
    if os.geteuid() == 0:
        return []
    effective = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            effective = int(line.split()[1], 16)
    return [name for name, bit in NEEDED_CAPABILITIES.items() if not effective & (1 << bit)]


def run_as(argv: list[str]) -> list[str]:
    """``argv`` as the model user would run it (``argv`` itself when none is set)."""
    user = model_user()
    if user is None:
        return argv
    missing = missing_capabilities()
    if missing:
        raise PermanentError(
            f"GANTRY_MODEL_USER is {user.pw_name}, but the worker may not switch to it: it is not root and lacks "
            f"{', '.join(missing)} (the unit gantry join writes grants them: AmbientCapabilities=)"
        )
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise PermanentError("GANTRY_MODEL_USER is set, but setpriv is not installed (util-linux)")
    return [
        setpriv,
        f"--reuid={user.pw_uid}",
        f"--regid={user.pw_gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--ambient-caps=-all",
        "--no-new-privs",
        "--",
        *argv,
    ]


def unreadable(paths: list[Path]) -> list[Path]:
    """Those of ``paths`` the model user cannot read (a folder above closed to
    other users, say): asked as that user. None when no model user is set."""
    if model_user() is None or not paths:
        return []
    script = 'for p; do [ -r "$p" ] || echo "$p"; done'
    done = subprocess.run(run_as(["sh", "-c", script, "sh", *map(str, paths)]), capture_output=True, text=True)
    return [Path(line) for line in done.stdout.splitlines()]


def require_readable(paths: list[Path]) -> None:
    """Refuse, naming them, when the model user cannot read ``paths``."""
    closed = unreadable(paths)
    if closed:
        raise PermanentError(
            f"the model user {settings.GANTRY_MODEL_USER} cannot read {', '.join(map(str, closed))}: "
            "open the folders above them to other users (chmod o+rx), or move them"
        )


def own_folder(beside: Path) -> Path:
    """The model's own folder in ``beside`` (mode 0700), given to the model user:
    its home and caches (where a checkpoint's own code is copied
    to be imported). The worker's own when no model user is set."""
    path = beside / FOLDER_NAME
    user = model_user()
    if path.is_dir() and user is not None and path.stat().st_uid == user.pw_uid:
        return path  # made before, for this user: what is inside is the model's
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if user is not None:
        os.chown(path, user.pw_uid, user.pw_gid, follow_symlinks=False)
    return path


def remove_folders(root: Path) -> None:
    """Remove the model's folders in ``root`` or its subfolders, as the model user
    (the worker may not look inside them), before the worker removes ``root``."""
    if model_user() is None:
        return
    for folder in [root / FOLDER_NAME, *root.glob(f"*/{FOLDER_NAME}")]:
        if folder.is_dir():  # what is in it is the model's; the folder itself sits in the worker's
            subprocess.run(run_as(["find", str(folder), "-mindepth", "1", "-delete"]), check=False, timeout=120)
            folder.rmdir()


def environment(folder: Path) -> dict[str, str]:
    """Where model code keeps what it writes: its own folder."""
    return {
        "HOME": str(folder),
        "XDG_CACHE_HOME": str(folder / "cache"),
        "HF_MODULES_CACHE": str(folder / "hf-modules"),
    }
