"""A local stand-in for the model hub: the endpoints huggingface_hub's snapshot
download calls (repository info, the recursive tree, HEAD and ranged GET of a
file), serving repositories a test makes. The only stand-in in the download
path: everything behind it is the real library.

Files over LFS_ABOVE bytes are listed as LFS objects (sha256, X-Linked-Etag),
the rest as git blobs (sha1), as the hub does. A repository may be gated (a
token is needed), a file may be served corrupted (other bytes under its
name), and transfers may be throttled (to catch a download mid-way).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_ABOVE = 1024


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()  # noqa: S324 - git's object id


@dataclass
class Repo:
    files: dict[str, bytes]
    gated_token: str = ""  # non-empty: only this token may read it
    corrupt: set[str] = field(default_factory=set)  # served with other bytes
    listed_sizes: dict[str, int] = field(default_factory=dict)  # sizes the tree claims instead of the real ones

    # Each file's hashes, by the bytes object they were computed from (a test may swap files).
    _hashes: dict[str, tuple[bytes, str, str]] = field(default_factory=dict, repr=False)

    def _hashed(self, path: str) -> tuple[str, str]:
        data = self.files[path]
        known = self._hashes.get(path)
        if known is None or known[0] is not data:
            known = self._hashes[path] = (data, git_blob_id(data), hashlib.sha256(data).hexdigest())
        return known[1], known[2]

    @property
    def commit(self) -> str:
        digest = hashlib.sha1()  # noqa: S324 - a commit id
        for path in sorted(self.files):
            digest.update(path.encode() + self._hashed(path)[1].encode())
        return digest.hexdigest()

    def entry(self, path: str) -> dict:
        data = self.files[path]
        blob_id, sha256 = self._hashed(path)
        size = self.listed_sizes.get(path, len(data))
        item = {"type": "file", "path": path, "size": size, "oid": blob_id}
        if len(data) > LFS_ABOVE:
            item["lfs"] = {"oid": sha256, "size": size, "pointerSize": 134}
        return item


class HubServer:
    """Serve ``repos`` at http://<address>:<port>; ``requests`` records what was asked."""

    def __init__(self, repos: dict[str, Repo], *, port: int = 0, rate_bps: int = 0, address: str = "127.0.0.1") -> None:
        self.repos = repos
        self.rate_bps = rate_bps
        self.requests: list[tuple[str, str, str]] = []  # (method, path, Range header)
        self.httpd = ThreadingHTTPServer((address, port), _handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://{address}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def ranged(self) -> list[str]:
        """The files asked for from an offset (a download resumed)."""
        return [path for method, path, ranged in self.requests if method == "GET" and ranged]


_INFO = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$")
_TREE = re.compile(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)$")
_FILE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(body=True)

        def _refuse(self, status: int, code: str, message: str) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _json(self, value: object, body: bool) -> None:
            data = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _repo(self, repo_id: str, revision: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._refuse(401, "RepoNotFound", "Repository not found")
                return None
            if repo.gated_token and self.headers.get("Authorization") != f"Bearer {repo.gated_token}":
                self._refuse(401 if not self.headers.get("Authorization") else 403, "GatedRepo", "Access restricted")
                return None
            if revision not in ("main", repo.commit):
                self._refuse(404, "RevisionNotFound", "Invalid rev id")
                return None
            return repo

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range", "")))
            if match := _INFO.match(path):
                repo = self._repo(match[1], unquote(match[2] or "main"))
                if repo is not None:
                    siblings = [{"rfilename": p} for p in sorted(repo.files)]
                    self._json({"id": match[1], "sha": repo.commit, "siblings": siblings, "private": False}, body)
            elif match := _TREE.match(path):
                repo = self._repo(match[1], match[2])
                if repo is not None:
                    self._json([repo.entry(p) for p in sorted(repo.files)], body)
            elif match := _FILE.match(path):
                repo = self._repo(match[1], match[2])
                if repo is not None:
                    self._file(repo, match[3], body)
            else:
                self._refuse(404, "EntryNotFound", "no such endpoint")

        def _file(self, repo: Repo, name: str, body: bool) -> None:
            if name not in repo.files:
                self._refuse(404, "EntryNotFound", "Entry not found")
                return
            data = repo.files[name]
            entry = repo.entry(name)
            served = bytes(b ^ 0xFF for b in data) if name in repo.corrupt else data
            start = 0
            if match := re.match(r"bytes=(\d+)-", self.headers.get("Range", "")):
                start = min(int(match[1]), len(served))
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("ETag", f'"{entry["oid"]}"')
            if "lfs" in entry:
                self.send_header("X-Linked-Etag", f'"{entry["lfs"]["oid"]}"')
                self.send_header("X-Linked-Size", str(entry["size"]))
            self.send_header("Accept-Ranges", "bytes")
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(served) - 1}/{len(served)}")
            self.send_header("Content-Length", str(len(served) - start))
            self.end_headers()
            if body:
                self._send(served[start:])

        def _send(self, data: bytes) -> None:
            chunk = 64 * 1024
            for offset in range(0, len(data), chunk):
                self.wfile.write(data[offset : offset + chunk])
                if hub.rate_bps:
                    time.sleep(chunk / hub.rate_bps)

    return Handler
