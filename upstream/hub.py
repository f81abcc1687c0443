"""The model hub, through huggingface_hub: the one module that calls it.

``resolve`` asks the hub (or the mirror at ``endpoint``) which commit a
revision points at and which files a download takes there, with their sizes
and hashes. ``download_command`` is the command that downloads them: this
module run as a program, calling huggingface_hub's own snapshot download
(files in parallel, resumed from the partial files an interrupted run left),
in a process of its own so that a cancel stops it at once and the host
worker's death leaves what it fetched (the next run finishes a partial file
from where it stopped). ``progress`` reads how far it got
from the cache's files; ``verify`` checks every file against its hash, which
huggingface_hub does not (a mirror or a broken proxy could hand over other
bytes under the right name).

The files land in a cache of the hub's own layout: blobs named by their hash,
a snapshot folder per commit whose files link to them.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import PermanentError, TransientError

# The access token reaches the download process in its environment (never on its command line).
TOKEN_VARIABLE = "HF_TOKEN"


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int
    blob_id: str  # git's sha1 of the file
    sha256: str | None  # the LFS object's hash, for a file stored in LFS

    @property
    def blob(self) -> str:
        """The file's name among the cache's blobs (the hub's ETag for it)."""
        return self.sha256 or self.blob_id


@dataclass(frozen=True)
class Snapshot:
    """What a download takes: a repository's files at one commit, filtered."""

    hub_id: str
    commit: str
    files: tuple[HubFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def check_repo_id(hub_id: str) -> str | None:
    """Why ``hub_id`` is no hub repository id ("org/name"), or None."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if hub_id.count("/") != 1:
        return "must be a repository id, owner/name"
    try:
        validate_repo_id(hub_id)
    except HFValidationError as exc:
        return str(exc).split("\n")[0]
    return None


def storage(cache: Path, hub_id: str) -> Path:
    """The repository's folder in a cache of the hub's layout."""
    return cache / ("models--" + hub_id.replace("/", "--"))


def resolve(
    hub_id: str, revision: str, *, allow: list[str], ignore: list[str], endpoint: str, token: str, timeout: float = 30
) -> Snapshot:
    """The commit ``revision`` points at and the files a download takes there.
    PermanentError for what asking again will not change (no such repository or
    revision, a gated or private one this token cannot read), TransientError for
    a hub that is away."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    api = HfApi(endpoint=endpoint or None, token=token or False)
    where = f"{hub_id}@{revision or 'main'}"
    try:
        info = api.repo_info(hub_id, revision=revision or None, timeout=timeout)
        if not info.sha:
            raise PermanentError(f"the hub named no commit for {where}")
        tree = [f for f in api.list_repo_tree(hub_id, recursive=True, revision=info.sha) if isinstance(f, RepoFile)]
    except GatedRepoError as exc:
        raise PermanentError(
            f"{hub_id} is gated: the hub refused this host "
            + ("its token (accept the model's terms on the hub with that account)" if token else "without an access "
               "token (set GANTRY_HUB_TOKEN on the host, for an account that accepted the model's terms)")
        ) from exc  # fmt: skip
    except RevisionNotFoundError as exc:
        raise PermanentError(f"{hub_id} has no revision {revision!r}") from exc
    except RepositoryNotFoundError as exc:
        raise PermanentError(
            f"no repository {hub_id} on the hub, or it is private and this host's token cannot read it"
        ) from exc
    except HfHubHTTPError as exc:
        code = exc.response.status_code if exc.response is not None else 0
        if code in (401, 403):
            raise PermanentError(f"the hub refused {where} ({code}): {_first_line(exc)}") from exc
        raise TransientError(f"the hub failed {where} ({code}): {_first_line(exc)}") from exc
    except (httpx2.TransportError, OSError) as exc:
        raise TransientError(f"the hub could not be reached for {where}: {exc}") from exc
    kept = filter_repo_objects(tree, allow_patterns=allow or None, ignore_patterns=ignore or None, key=lambda f: f.path)
    files = tuple(HubFile(f.path, f.size, f.blob_id, f.lfs.sha256 if f.lfs else None) for f in kept)
    if not files:
        raise PermanentError(f"no file of {where} matches the allow and ignore patterns")
    return Snapshot(hub_id=hub_id, commit=info.sha, files=files)


def download_command(snapshot: Snapshot, *, cache: Path, endpoint: str, workers: int) -> list[str]:
    """The program that downloads ``snapshot`` into ``cache`` (run it with the
    token, if any, in TOKEN_VARIABLE)."""
    order = {"hub_id": snapshot.hub_id, "commit": snapshot.commit, "files": [f.path for f in snapshot.files],
             "files_by_blob": {f.blob: (f.path, f.size) for f in snapshot.files},
             "cache": str(cache), "endpoint": endpoint, "workers": workers}  # fmt: skip
    return [sys.executable, "-m", "upstream.hub", json.dumps(order)]


def _download(order: dict) -> None:
    from huggingface_hub import snapshot_download

    token = os.environ.get(TOKEN_VARIABLE) or False
    _resume_partials(order, token)
    snapshot_download(
        order["hub_id"],
        revision=order["commit"],
        cache_dir=order["cache"],
        # Exactly these files: a name with *, ? or [ in it is no pattern here.
        allow_patterns=[glob.escape(path) for path in order["files"]],
        max_workers=order["workers"],
        endpoint=order["endpoint"] or None,
        token=token,
    )


def _resume_partials(order: dict, token: str | bool) -> None:
    """Finish, from where they stopped, the files a killed download left part-way.

    huggingface_hub resumes a file within one process (a dropped connection)
    but writes each attempt to a name of its own, so a process that was killed
    leaves its partial file behind unused. Each such file is completed here
    with a ranged request (the library's own http_get, its resume and headers)
    and moved into place as its blob, which the snapshot download then links
    instead of fetching it again.
    """
    from huggingface_hub import hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    blobs = storage(Path(order["cache"]), order["hub_id"]) / "blobs"
    for partial in sorted(blobs.glob("*.incomplete"), key=lambda p: -p.stat().st_size):
        blob = blobs / partial.name.split(".", 1)[0]
        wanted = order["files_by_blob"].get(blob.name)
        if wanted is None or blob.exists() or not partial.exists():
            partial.unlink(missing_ok=True)
            continue
        path, size = wanted
        for other in blobs.glob(f"{blob.name}.*incomplete"):
            if other != partial:
                other.unlink(missing_ok=True)
        url = hf_hub_url(order["hub_id"], path, revision=order["commit"], endpoint=order["endpoint"] or None)
        with partial.open("ab") as out:
            done = out.tell()
            http_get(url, out, resume_size=done, headers=build_hf_headers(token=token), expected_size=size)
        partial.replace(blob)


@dataclass(frozen=True)
class Progress:
    bytes_done: int
    files_done: int


def progress(snapshot: Snapshot, cache: Path) -> Progress:
    """How much of ``snapshot`` is in ``cache``: whole blobs, and what partial
    ones hold (a resumed download counts what it had)."""
    blobs = storage(cache, snapshot.hub_id) / "blobs"
    done = files = 0
    for f in snapshot.files:
        whole = blobs / f.blob
        if whole.is_file():
            done, files = done + f.size, files + 1
            continue
        partial = 0
        for part in blobs.glob(f"{f.blob}.*incomplete"):  # huggingface_hub's name, or a resumed one's
            with contextlib.suppress(OSError):
                partial = max(partial, part.stat().st_size)
        done += min(f.size, partial)
    return Progress(bytes_done=done, files_done=files)


def bytes_missing(snapshot: Snapshot, cache: Path) -> int:
    """What a download of ``snapshot`` still has to write to ``cache``."""
    return snapshot.total_bytes - progress(snapshot, cache).bytes_done


class Follower:
    """Hashes a snapshot's files as they are written, so that checking them
    costs nothing once the download ends. ``step`` reads what each file gained
    since the last step (the partial file huggingface_hub writes is renamed
    into place as its blob: the same file, read on). A digest counts only for
    the blob it was read from, read whole; anything else (a partial file
    rewritten, abandoned or replaced) is hashed again by ``verify``."""

    def __init__(self, snapshot: Snapshot, cache: Path) -> None:
        self.blobs = storage(cache, snapshot.hub_id) / "blobs"
        self.waiting = {f.blob: f for f in snapshot.files}
        self.reading: dict[str, tuple[Any, Any]] = {}
        self.hashed: dict[str, tuple[int, str]] = {}  # blob -> (inode, digest)

    def step(self) -> None:
        for blob, f in list(self.waiting.items()):
            if blob not in self.reading:
                whole = self.blobs / blob
                found = [whole] if whole.exists() else sorted(self.blobs.glob(f"{blob}.*incomplete"))
                try:
                    self.reading[blob] = (found[0].open("rb"), _digest(f, f.size)) if found else None
                except OSError:
                    self.reading[blob] = None
                if self.reading[blob] is None:
                    del self.reading[blob]
                    continue
            handle, digest = self.reading[blob]
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
            with contextlib.suppress(OSError):
                inode = os.fstat(handle.fileno()).st_ino
                if handle.tell() == f.size and (self.blobs / blob).stat().st_ino == inode:
                    self.hashed[blob] = (inode, digest.hexdigest())
                    self._drop(blob)

    def _drop(self, blob: str) -> None:
        handle, _ = self.reading.pop(blob)
        handle.close()
        self.waiting.pop(blob, None)

    def close(self) -> None:
        for blob in list(self.reading):
            self._drop(blob)


def verify(snapshot: Snapshot, cache: Path, hashed: dict[str, tuple[int, str]] | None = None) -> list[str]:
    """Check every file of the downloaded snapshot against its hash (sha256 for
    an LFS file, git's sha1 otherwise): from what a Follower read as it was
    written, where that matches, else read again here. A file that differs is
    removed (blob and link), so the next download fetches it again; what
    differed, in words."""
    folder = storage(cache, snapshot.hub_id)
    problems = []
    for f in snapshot.files:
        link = folder / "snapshots" / snapshot.commit / f.path
        expected = f.sha256 or f.blob_id
        try:
            blob = link.resolve(strict=True)
            early = (hashed or {}).get(f.blob)
            if early is not None and early == (blob.stat().st_ino, expected):
                continue
            found = _hash(blob, f)
        except OSError:
            problems.append(f"{f.path}: missing after the download")
            continue
        if found != expected:
            problems.append(
                f"{f.path}: its content hashes to {found[:12]}, the hub lists {(f.sha256 or f.blob_id)[:12]}"
            )
            for gone in (link.resolve(), link):
                gone.unlink(missing_ok=True)
    return problems


def git_object(size: int) -> Any:
    """A sha1 that, fed a file's ``size`` bytes, gives its git object id (the hub's id of a non-LFS file)."""
    return hashlib.sha1(f"blob {size}\0".encode())  # noqa: S324 - git's object id


def _digest(f: HubFile, size: int) -> Any:
    return hashlib.sha256() if f.sha256 else git_object(size)


def _hash(path: Path, f: HubFile) -> str:
    digest = _digest(f, path.stat().st_size)
    with path.open("rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().split("\n")[0][:300]


if __name__ == "__main__":
    _download(json.loads(sys.argv[1]))
