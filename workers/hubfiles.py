"""This host's hub cache, served read-only in the hub's own protocol, on
loopback only: the channel forwards the control plane's relay to it
(deployments.web.hub_relay), so that a host that reaches neither the hub nor a
mirror fetches a model from a host that holds it (GANTRY_HUB_VIA_CONTROL_PLANE).

It answers what huggingface_hub's snapshot download asks, for the commits the
cache holds: a revision (a commit only), the tree of a snapshot, and each
file (HEAD and ranged GET) with the headers the hub sends (X-Repo-Commit, the
ETag, and for an LFS file X-Linked-Etag and X-Linked-Size). A file's ETag is
its blob's name in the cache, the hash the hub gave it; an LFS file's tree
entry carries the git id of its LFS pointer, as the hub's does.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from django.conf import settings

from triton_server.server import LOCAL
from upstream import hub

log = logging.getLogger(__name__)

_INFO = re.compile(r"^/api/models/([\w.-]+)/([\w.-]+)/revision/([0-9a-f]{40})$")
_TREE = re.compile(r"^/api/models/([\w.-]+)/([\w.-]+)/tree/([0-9a-f]{40})$")
_FILE = re.compile(r"^/([\w.-]+)/([\w.-]+)/resolve/([0-9a-f]{40})/(.+)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_server: ThreadingHTTPServer | None = None


def lfs_pointer_id(sha256: str, size: int) -> str:
    """The git id of the LFS pointer file of an object (the tree's ``oid`` for an LFS file)."""
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
    digest = hub.git_object(len(pointer))
    digest.update(pointer)
    return digest.hexdigest()


def _snapshot(owner: str, name: str, commit: str) -> Path | None:
    if ".." in (owner, name):
        return None
    folder = Path(settings.GANTRY_HUB_CACHE) / f"models--{owner}--{name}" / "snapshots" / commit
    return folder if folder.is_dir() else None


def _entries(snapshot: Path) -> list[dict]:
    storage = snapshot.parent.parent
    found = []
    for link in sorted(snapshot.rglob("*")):
        if not (link.is_symlink() or link.is_file()):
            continue
        blob = link.resolve()
        if storage not in blob.parents:
            continue
        size = blob.stat().st_size
        entry = {"type": "file", "path": str(link.relative_to(snapshot)), "size": size, "oid": blob.name}
        if _SHA256.match(blob.name):
            entry["oid"] = lfs_pointer_id(blob.name, size)
            entry["lfs"] = {"oid": blob.name, "size": size, "pointerSize": 134}
        found.append(entry)
    return found


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(body=True)

    def _send(self, status: int, headers: dict[str, str], data: bytes = b"", body: bool = True) -> None:
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(data))}.items():
            self.send_header(name, value)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _missing(self, code: str, message: str) -> None:
        self._send(404, {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"},
                   json.dumps({"error": message}).encode())  # fmt: skip

    def _answer(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        json_type = {"Content-Type": "application/json"}
        if (match := _INFO.match(path)) and _snapshot(*match.groups()):
            data = json.dumps({"id": f"{match[1]}/{match[2]}", "sha": match[3], "private": False}).encode()
            self._send(200, json_type, data, body)
        elif (match := _TREE.match(path)) and (snapshot := _snapshot(*match.groups())):
            self._send(200, json_type, json.dumps(_entries(snapshot)).encode(), body)
        elif (match := _FILE.match(path)) and (snapshot := _snapshot(*match.groups()[:3])):
            self._file(snapshot, match[3], match[4], body)
        else:
            self._missing("RevisionNotFound", "this host's cache holds no such commit")

    def _file(self, snapshot: Path, commit: str, name: str, body: bool) -> None:
        link = snapshot / name
        blob = link.resolve() if link.exists() else None
        if blob is None or snapshot.parent.parent not in blob.parents or ".." in Path(name).parts:
            self._missing("EntryNotFound", "no such file in that commit here")
            return
        size = blob.stat().st_size
        start = 0
        if match := re.match(r"bytes=(\d+)-", self.headers.get("Range", "")):
            start = min(int(match[1]), size)
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("Accept-Ranges", "bytes")
        if _SHA256.match(blob.name):
            self.send_header("ETag", f'"{lfs_pointer_id(blob.name, size)}"')
            self.send_header("X-Linked-Etag", f'"{blob.name}"')
            self.send_header("X-Linked-Size", str(size))
        else:
            self.send_header("ETag", f'"{blob.name}"')
        if start:
            self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        self.send_header("Content-Length", str(size - start))
        self.end_headers()
        if body:
            with blob.open("rb") as stream:
                stream.seek(start)
                shutil.copyfileobj(stream, self.wfile, 1 << 20)


def serve() -> None:
    """Serve the cache on loopback, GANTRY_HUB_FILES_PORT (once per process; a
    port taken is logged and left: the relay then finds no file server here)."""
    global _server
    if _server is not None or not settings.GANTRY_HUB_FILES_PORT:
        return
    try:
        _server = ThreadingHTTPServer((LOCAL, settings.GANTRY_HUB_FILES_PORT), _Handler)
    except OSError as exc:
        log.warning("the hub cache's file server could not listen on %s: %s", settings.GANTRY_HUB_FILES_PORT, exc)
        return
    _server.daemon_threads = True
    threading.Thread(target=_server.serve_forever, name="gantry-hub-files", daemon=True).start()
