"""A host downloading a hub model into its cache (deployments.models.ModelDownload).

The download itself is huggingface_hub's snapshot download in a process of
its own (upstream.hub), working in a folder of its own so that a worker that
starts after a dead one finds and stops what it left, then resumes from the
partial files. Before a byte moves, the files' sizes are checked against the
cache's free disk. Every half second the cache's files say how far it got;
the row gets the figures and answers whether a cancel was asked. At the end
every file is checked against its hash; the first host then inspects the
model, and every host records its copy for placement.
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import subprocess
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from django.conf import settings
from django.template.defaultfilters import filesizeformat

import upstream
from common import pki
from common.errors import InvalidTransition
from deployments import states
from deployments.models import DownloadStatus as D
from deployments.models import ModelDownload, RegisteredModel
from deployments.services import downloads
from upstream import hub
from workers import cache as cache_quota
from workers import channel, inspection, processes
from workers.deploy import copies
from workers.jobs import JobFailed, run_job, source

REPORT_EVERY_S = 0.5
# The rate is measured over this many seconds.
RATE_WINDOW_S = 5.0
# Free disk a download leaves untouched.
DISK_RESERVE_BYTES = 256 * 1024 * 1024
LOG_TAIL_CHARACTERS = 2000


def run_download(download_id: int) -> None:
    """Download, verify and record one hub model on this host; whatever stops it
    ends the row failed (or cancelled) with the reason."""
    run_job(
        "download",
        lambda: _download(download_id),
        fail=lambda reason, *, status, details: _end(download_id, status or D.FAILED, reason),
    )


def _end(download_id: int, to: str, reason: str) -> None:
    with contextlib.suppress(InvalidTransition):
        downloads.download_end(download_id=download_id, to=to, source=source(), message=reason)


@contextlib.contextmanager
def _claimed(work: Path) -> Iterator[bool]:
    """Hold the download's lock on this host (False: another worker process holds it)."""
    work.mkdir(parents=True, exist_ok=True)
    with (work / "lock").open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def _download(download_id: int) -> None:
    download = ModelDownload.objects.select_related("model", "host").filter(pk=download_id).first()
    if download is None or download.status in states.DOWNLOAD_TERMINAL:
        return
    if download.host.name != settings.GANTRY_HOST_NAME:
        raise JobFailed(f"download {download_id} belongs to {download.host.name}, not {settings.GANTRY_HOST_NAME}")
    cache = Path(settings.GANTRY_HUB_CACHE)
    work = cache / ".gantry" / f"download-{download_id}"
    with _claimed(work) as mine:
        if not mine:
            return  # a live worker of this host runs it (a task sent twice)
        processes.stop_groups_working_in(work)  # what a dead worker's download left running
        download.refresh_from_db()
        if download.status == D.CANCELLING:
            _end(download_id, D.CANCELLED, "cancelled before it started")
            return
        if download.status not in (D.PENDING, D.RUNNING):
            return
        model = download.model
        states.download_transition(
            download_id=download_id,
            to=D.RUNNING,
            source=source(),
            message="resumed by a new worker (its partial files are kept)"
            if download.status == D.RUNNING
            else f"resolving {model.hub_id}@{model.commit or model.revision or 'main'}",
        )
        endpoint, token = _endpoint_and_token(download_id)
        snapshot = _resolve(model, endpoint, token)
        _check_disk(download_id, model, snapshot, cache)
        follower = hub.Follower(snapshot, cache)  # hashes the files as they arrive
        ended = _fetch(download_id, snapshot, cache, work, follower, endpoint, token)
        if ended is not None:
            _end(download_id, ended, "cancelled; the files fetched so far stay in the cache and a new download resumes")
            return
        problems = hub.verify(snapshot, cache, follower.hashed)
        if problems:
            raise JobFailed(f"{len(problems)} file(s) failed their hash and were removed: {'; '.join(problems)}")
        done = hub.progress(snapshot, cache)
        downloads.download_progress(download_id=download_id, bytes_done=done.bytes_done, files_done=done.files_done)
        said = (
            f"{len(snapshot.files)} files, {filesizeformat(snapshot.total_bytes)} at commit {snapshot.commit[:12]}, "
            "each checked against its hash"
        )
        download.refresh_from_db()
        model, first = download.model, download.is_first
        if not first:
            copies.look_at(model)  # placement (and a replica waiting for it) sees the copy first
        downloads.download_end(download_id=download_id, to=D.SUCCEEDED, source=source(), message=said)
    shutil.rmtree(work, ignore_errors=True)
    if first:
        inspection.inspect(model.pk)


def _endpoint_and_token(download_id: int) -> tuple[str, str]:
    """Where this host downloads from, and the token it shows there: the hub (or
    its mirror) with the host's own token, or the control plane's relay
    (GANTRY_HUB_VIA_CONTROL_PLANE) with the download signed by its channel key."""
    if not settings.GANTRY_HUB_VIA_CONTROL_PLANE:
        return settings.GANTRY_HUB_ENDPOINT, settings.GANTRY_HUB_TOKEN
    key = channel.folder() / channel.KEY
    if not key.exists():
        raise JobFailed("GANTRY_HUB_VIA_CONTROL_PLANE needs this host's channel key, and it has none yet")
    signed = pki.prove(pki.load_key(key.read_text()), downloads.relay_token_text(download_id))
    return f"{settings.GANTRY_GATEWAY_URL.rstrip('/')}/hub", f"{download_id}.{signed}"


def _resolve(model: RegisteredModel, endpoint: str, token: str) -> hub.Snapshot:
    """The files to fetch, at the commit every host of the model gets."""
    resolve = lambda revision: hub.resolve(  # noqa: E731
        model.hub_id,
        revision,
        allow=model.allow_patterns,
        ignore=model.ignore_patterns,
        endpoint=endpoint,
        token=token,
    )
    snapshot = resolve(model.commit or model.revision)
    commit = downloads.model_commit_record(model_id=model.pk, commit=snapshot.commit)
    if commit != snapshot.commit:  # another host resolved it first, to another commit
        snapshot = resolve(commit)
    model.commit = commit
    return snapshot


def _check_disk(download_id: int, model: RegisteredModel, snapshot: hub.Snapshot, cache: Path) -> None:
    """Room for the files still to fetch: within the cache's quota (evicting the
    least recently used models), then on the disk."""
    needed = hub.bytes_missing(snapshot, cache)
    if cache_quota.make_room(needed, keep=model):  # each eviction is on its model's timeline
        downloads.download_progress(download_id=download_id)  # a heartbeat: removing files takes a moment
    cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache).free
    if needed > free - DISK_RESERVE_BYTES:
        raise JobFailed(
            f"not enough disk: {snapshot.hub_id} needs {filesizeformat(needed)} more in {cache} and "
            f"{filesizeformat(max(0, free))} is free ({filesizeformat(DISK_RESERVE_BYTES)} is kept free); "
            "nothing was downloaded"
        )


def _fetch(
    download_id: int, snapshot: hub.Snapshot, cache: Path, work: Path, follower: hub.Follower, endpoint: str, token: str
) -> str | None:
    """Run the download process to its end, reporting progress; the end status
    when a cancel stopped it, None when it finished."""
    start = hub.progress(snapshot, cache)
    downloads.download_progress(
        download_id=download_id,
        commit=snapshot.commit,
        files_total=len(snapshot.files),
        bytes_total=snapshot.total_bytes,
        files_done=start.files_done,
        bytes_done=start.bytes_done,
    )
    env = processes.child_environment(
        {
            "PYTHONPATH": str(Path(upstream.__file__).resolve().parent.parent),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            **({hub.TOKEN_VARIABLE: token} if token else {}),
        }
    )
    log = work / "download.log"
    with log.open("wb") as out:
        process = processes.start_group(
            hub.download_command(
                snapshot,
                cache=cache,
                endpoint=endpoint,
                workers=settings.GANTRY_HUB_DOWNLOAD_WORKERS,
            ),
            env=env,
            cwd=work,
            stdout=out,
        )
    seen: deque[tuple[float, int]] = deque([(time.monotonic(), start.bytes_done)])
    try:
        while True:
            exited = _wait(process, REPORT_EVERY_S)
            follower.step()
            now = hub.progress(snapshot, cache)
            seen.append((time.monotonic(), now.bytes_done))
            while len(seen) > 2 and seen[-1][0] - seen[0][0] > RATE_WINDOW_S:
                seen.popleft()
            span = seen[-1][0] - seen[0][0]
            rate = int((seen[-1][1] - seen[0][1]) / span) if span > 0 else 0
            status = downloads.download_progress(
                download_id=download_id, bytes_done=now.bytes_done, files_done=now.files_done, rate_bps=max(0, rate)
            )
            if status == D.CANCELLING:
                processes.terminate_group(process.pid, grace_s=5)
                process.wait()
                return D.CANCELLED
            if status != D.RUNNING:
                raise JobFailed(f"the download became {status} while it ran")
            if exited is not None:
                break
    finally:
        follower.close()
        if process.poll() is None:
            processes.terminate_group(process.pid, grace_s=5)
            process.wait()
    if process.returncode != 0:
        tail = log.read_text(errors="replace")[-LOG_TAIL_CHARACTERS:].strip()
        raise JobFailed(f"huggingface_hub's download exited with {process.returncode}: {_last_error(tail)}")
    return None


def _wait(process: subprocess.Popen, timeout: float) -> int | None:
    """The process's exit status once it ends within ``timeout``, else None."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _last_error(tail: str) -> str:
    """The line of a Python traceback that says what went wrong (the last one)."""
    lines = [line for line in tail.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
