"""The process runtime: tritonserver as a local process, from the
nvidia-pytriton wheel's build of Triton.

The server runs in its own session (so a worker restart does not take serving
models down with it); its process id is the handle Gantry stores. A handle is
only trusted while /proc shows that id running this deployment's repository,
so a recycled process id is never signalled.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from common.errors import PermanentError, TransientError
from common.once import make_once
from triton_server.server import STOP_GRACE_S, LaunchSpec, server_settings, tritonserver_args
from workers import model_user, processes
from workers.runtimes.base import MAX_LOG_LINES, ServerExit

log = logging.getLogger(__name__)


def _triton_dist() -> Path:
    # Found, not imported: the wheel's tritonserver tree is all Gantry uses, and
    # importing pytriton would pull in its own client library's dependencies.
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise PermanentError("nvidia-pytriton is not installed on this host (pip install 'gantry[worker]')")
    return Path(next(iter(spec.submodule_search_locations))) / "tritonserver"


def triton_binary() -> Path:
    """The tritonserver the process runtime runs (the nvidia-pytriton wheel's)."""
    return _triton_dist() / "bin" / "tritonserver"


def _libs_dir() -> Path:
    return _triton_dist().parent.parent / "nvidia_pytriton.libs"


def prepare_backends(data_dir: Path) -> Path:
    """A backends/ folder whose python backend has the stub for this interpreter.

    The wheel ships one stub per CPython version; Triton looks for the stub
    beside libtriton_python.so. Done once per host under a file lock.
    """
    target = data_dir / "triton" / f"backends-py{sys.version_info.major}.{sys.version_info.minor}"
    marker = target / ".complete"

    def make() -> None:
        dist = _triton_dist()
        stub = dist / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = stub / "triton_python_backend_stub"
        if not stub.exists():
            raise PermanentError(f"the Triton wheel has no python-backend stub for Python {sys.version_info[:2]}")
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(dist / "backends", target, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(stub, target / "python" / "triton_python_backend_stub")
        marker.touch()

    make_once(target.parent, marker.exists, make)
    return target


def server_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment under which tritonserver and its python stubs find their libraries.

    The stub links libpython dynamically: put this interpreter's own libpython
    first so the stub runs the same Python (and extension ABI) as this
    environment, and this environment's bin/ first on PATH so the embedded
    interpreter picks up its site-packages.
    """
    env = processes.child_environment()
    lib_dirs = []
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        lib_dirs.append(str(sysconfig.get_config_var("LIBDIR")))
    lib_dirs.append(str(_libs_dir()))
    if env.get("LD_LIBRARY_PATH"):
        lib_dirs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(lib_dirs)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    # Checkpoints are local folders: never reach for a model hub.
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.update(extra or {})
    return env


def runtime_paths() -> list[Path]:
    """What tritonserver and its python stubs read to start, beside the backends:
    the binary, this interpreter and its standard library."""
    paths = [triton_binary(), Path(sys.executable).resolve(), Path(sysconfig.get_paths()["stdlib"])]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        paths.append(Path(sysconfig.get_config_var("LIBDIR")))
    return paths


def command_line(spec: LaunchSpec, backends: Path) -> list[str]:
    return [str(triton_binary()), *tritonserver_args(spec), f"--backend-directory={backends}"]


def start(spec: LaunchSpec, *, data_dir: Path) -> str:
    """Start tritonserver for ``spec``; return its handle (the process id)."""
    backends = prepare_backends(data_dir)
    model_user.require_readable([*runtime_paths(), backends, spec.repository])
    own = model_user.own_folder(spec.repository.parent)
    env = server_environment({**model_user.environment(own), **spec.extra_env})
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(spec.log_path, "ab") as log_file:
        try:
            process = processes.start_group(
                model_user.run_as(command_line(spec, backends)),
                stdout=log_file,
                env=env,
                cwd=spec.repository.parent,
            )
        except PermanentError as exc:
            raise PermanentError(f"could not start tritonserver: {exc}") from exc
    log.info("started tritonserver pid %s for %s", process.pid, spec.repository)
    return str(process.pid)


def _repository_arg(repository: Path) -> bytes:
    return f"--model-repository={repository}".encode()


def _exit_file(repository: Path) -> Path:
    return repository.parent / "tritonserver.exit"


def is_running(handle: str, repository: Path) -> bool:
    """True while ``handle`` is a live tritonserver serving ``repository``."""
    if not handle.isdigit():
        return False
    # A server this process started and that exited is not left a zombie; its
    # status is kept beside the repository for whichever process asks (exit_of).
    returncode = processes.reap(int(handle))
    if returncode is not None and repository.parent.is_dir():
        _exit_file(repository).write_text(f"{handle} {returncode}\n")
    return processes.is_ours(int(handle), argv_contains=_repository_arg(repository))


def exit_of(handle: str, repository: Path) -> ServerExit:
    """How the server ``handle`` ended: from its zombie (its parent, a worker
    process, has not collected it yet) or from what ``is_running`` kept."""
    if not handle.isdigit():
        return ServerExit(None, unknown_why="it never started")
    returncode = processes.zombie_returncode(int(handle))
    if returncode is None:
        try:
            kept_handle, kept = _exit_file(repository).read_text().split()
        except (OSError, ValueError):
            kept_handle, kept = "", ""
        returncode = int(kept) if kept_handle == handle else None
    if returncode is None:
        return ServerExit(None, unknown_why="the worker that started it was gone when it ended")
    return ServerExit(returncode)


def servers_under(root: Path) -> list[tuple[str, Path]]:
    """(handle, repository) of every tritonserver serving a repository under ``root``.

    Finds servers whatever the database says, e.g. ones whose start was never
    recorded because the worker died in between.
    """
    found = []
    binary = str(triton_binary()).encode()
    prefix = f"--model-repository={root}/".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv or argv[0] != binary:
            continue
        for arg in argv:
            if arg.startswith(prefix) and is_running(entry.name, Path(arg.split(b"=", 1)[1].decode())):
                found.append((entry.name, Path(arg.split(b"=", 1)[1].decode())))
    return found


def stop(handle: str, repository: Path, *, grace_s: float = STOP_GRACE_S) -> None:
    """Stop the server and everything it started; returns once they are gone."""
    if handle.isdigit():
        processes.terminate_group(int(handle), grace_s=grace_s, leader_running=lambda: is_running(handle, repository))
        processes.reap(int(handle))


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a server log, for failure messages."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 16384))
            text = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class ProcessRuntime:
    """The Runtime interface over this module's functions."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir

    def start(self, spec: LaunchSpec) -> str:
        return start(spec, data_dir=self.data_dir)

    def is_running(self, handle: str, spec: LaunchSpec) -> bool:
        return is_running(handle, spec.repository)

    def stop(self, handle: str, spec: LaunchSpec) -> None:
        stop(handle, spec.repository)

    def log_tail(self, handle: str, spec: LaunchSpec, lines: int = 20) -> str:
        return log_tail(spec.log_path, lines)

    def server_changes(self, handle: str, spec: LaunchSpec) -> list[str]:
        """Why the running server cannot take ``spec`` in place: other server
        arguments (a process sees every folder and GPU of the host, and its
        configs name host GPUs, so a move reloads in place)."""
        try:
            argv = [a.decode() for a in processes.command_line(int(handle)) if a]
        except (OSError, ValueError):
            return []
        if server_settings(argv[1:]) != server_settings(tritonserver_args(spec)):
            return ["its server arguments differ"]
        return []

    def pids(self, handle: str, spec: LaunchSpec) -> list[int]:
        return processes.group_members(int(handle)) if handle.isdigit() else []

    def exit_of(self, handle: str, spec: LaunchSpec) -> ServerExit:
        return exit_of(handle, spec.repository)

    def stop_leftovers(self, spec: LaunchSpec) -> list[str]:
        found = [handle for handle, served in servers_under(spec.repository.parent) if served == spec.repository]
        for handle in found:
            stop(handle, spec.repository)
        return found

    def read_log(self, handle: str, spec: LaunchSpec, cursor: float | None) -> tuple[list[str], float]:
        try:
            with open(spec.log_path, "rb") as handle_:
                size = handle_.seek(0, os.SEEK_END)
                start = int(cursor) if cursor is not None and cursor <= size else max(0, size - 16384)
                handle_.seek(start)
                data = handle_.read(size - start)
        except FileNotFoundError:
            return [], cursor or 0.0  # not written yet
        except OSError as exc:
            raise TransientError(f"could not read the server's log {spec.log_path}: {exc.strerror}") from exc
        complete = data[: data.rfind(b"\n") + 1]  # a partial last line waits for the next read
        lines = complete.decode("utf-8", errors="replace").splitlines()
        if cursor is None:
            lines = lines[1:]  # the first line of a tail read may be cut
        return lines[-MAX_LOG_LINES:], float(start + len(complete))
