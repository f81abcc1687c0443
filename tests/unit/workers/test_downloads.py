"""Hub downloads (workers.downloads): huggingface_hub's real snapshot download
against a local hub-compatible server (tests.hubserver), into a real cache on
this machine's disk. Killing the process that runs a download, a corrupted
file, a gated model, a full disk and a cancel are done for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from django.db import connection
from django.test import override_settings

from common.errors import InvalidTransition, ValidationFailed
from core.models import Event
from deployments import states
from deployments.models import (
    CheckpointCopy,
    DeploymentStatus,
    DownloadStatus,
    Inspection,
    ModelDownload,
    RegisteredModel,
    Replica,
)
from deployments.services import deployments, downloads, registered_models
from deployments.services.placements import PlacementSpec
from tests import factories
from tests.hubserver import HubServer, Repo
from workers import downloads as worker
from workers.deploy import lifecycle

pytestmark = pytest.mark.django_db(transaction=True)
REPO = "tiny-org/tiny-embedder"
# huggingface_hub writes a file in 10 MiB pieces: a download caught mid-way needs a larger one.
LARGE = 24 * 1024 * 1024
MB = 1024 * 1024


def _files(seed: int = 0, weights_bytes: int = 3 * 1024 * 1024) -> dict[str, bytes]:
    shape = [weights_bytes // 2]
    header = json.dumps({"w": {"dtype": "F16", "shape": shape, "data_offsets": [0, weights_bytes]}}).encode()
    weights = len(header).to_bytes(8, "little") + header + os.urandom(weights_bytes)
    return {
        "config.json": json.dumps({"model_type": "bert", "hidden_size": 4, "seed": seed}).encode(),
        "model.safetensors": weights,
        "tokenizer.json": b"{}",
        "README.md": b"untrained weights, made by the test\n",
        "original/model.bin": b"x" * 4096,
    }


@pytest.fixture
def hub_settings(tmp_path: Path, settings):  # noqa: ANN001, ANN201
    settings.GANTRY_HUB_CACHE = tmp_path / "hub"
    settings.GANTRY_HUB_TOKEN = ""
    settings.GANTRY_HOST_NAME = "home"
    return settings


def _serve(repos: dict[str, Repo], settings, **options) -> HubServer:  # noqa: ANN001
    server = HubServer(repos, **options)
    settings.GANTRY_HUB_ENDPOINT = server.url
    return server


def _register(operator, **fields) -> RegisteredModel:  # noqa: ANN001, ANN003
    return registered_models.model_register(
        name="tiny", kind="embedding", host="home", hub_id=REPO, user=operator, **fields
    )


def _download(model: RegisteredModel, host: str = "home") -> ModelDownload:
    row = ModelDownload.objects.filter(model=model, host__name=host).order_by("-id").first()
    with override_settings(GANTRY_HOST_NAME=host):
        worker.run_download(row.pk)
    row.refresh_from_db()
    return row


def test_a_hub_model_is_downloaded_checked_inspected_and_held(hub_settings, operator):  # noqa: ANN001
    factories.cpu_host("home")
    repo = Repo(_files())
    with _serve({REPO: repo}, hub_settings):
        model = _register(operator, ignore_patterns=["original/*"])
        assert model.path == "" and model.inspection == Inspection.PENDING
        row = _download(model)
    assert row.status == DownloadStatus.SUCCEEDED, row.status_message
    assert row.commit == repo.commit and row.files_total == row.files_done == 4
    assert row.bytes_done == row.bytes_total == sum(len(v) for k, v in repo.files.items() if k != "original/model.bin")
    model.refresh_from_db()
    assert model.commit == repo.commit and model.inspection == Inspection.READY, model.inspection_message
    folder = hub_settings.GANTRY_HUB_CACHE / "models--tiny-org--tiny-embedder" / "snapshots" / repo.commit
    assert model.folder == folder and (folder / "model.safetensors").read_bytes() == repo.files["model.safetensors"]
    assert not (folder / "original").exists()
    assert CheckpointCopy.objects.get(model=model).host.name == "home"
    said = list(Event.objects.filter(kind="model.download", model=model).values_list("to_status", flat=True))
    assert said == ["pending", "running", "succeeded"]


def test_a_second_host_gets_the_commit_the_first_pinned_even_after_the_branch_moved(hub_settings, operator):  # noqa: ANN001
    factories.cpu_host("home")
    factories.cpu_host("other")
    repo = Repo(_files())
    with _serve({REPO: repo}, hub_settings) as server:
        model = _register(operator, revision="main")
        _download(model)
        pinned = repo.commit
        repo.files = _files(seed=1)  # main moves on; the old commit is no longer served
        hub_settings.GANTRY_HUB_CACHE = hub_settings.GANTRY_HUB_CACHE.parent / "other-hub"
        downloads.download_request(model_id=model.pk, host="other", user=operator)
        row = _download(model, "other")
    assert row.status == DownloadStatus.FAILED
    assert f"has no revision '{pinned}'" in row.status_message  # never main's new files under the old name
    assert [p for m, p, _ in server.requests if "/tree/" in p][-1].endswith(f"/tree/{pinned}")


def test_a_corrupted_file_is_caught_by_its_hash_removed_and_fetched_again(hub_settings, operator):  # noqa: ANN001
    factories.cpu_host("home")
    repo = Repo(_files(), corrupt={"model.safetensors", "config.json"})
    with _serve({REPO: repo}, hub_settings):
        model = _register(operator)
        row = _download(model)
        assert row.status == DownloadStatus.FAILED
        assert "2 file(s) failed their hash and were removed" in row.status_message
        assert "model.safetensors: its content hashes to" in row.status_message
        model.refresh_from_db()
        assert model.inspection == Inspection.FAILED and "failed their hash" in model.inspection_message
        assert not model.folder.joinpath("model.safetensors").exists()
        repo.corrupt.clear()
        downloads.download_request(model_id=model.pk, host="home", user=operator)
        row = _download(model)
    assert row.status == DownloadStatus.SUCCEEDED, row.status_message
    model.refresh_from_db()
    assert model.inspection == Inspection.READY
    assert (model.folder / "model.safetensors").read_bytes() == repo.files["model.safetensors"]
    with pytest.raises(InvalidTransition, match="home holds tiny already"):
        downloads.download_request(model_id=model.pk, host="home", user=operator)


def test_a_gated_model_without_a_token_is_refused_with_the_reason_and_read_with_one(hub_settings, operator):  # noqa: ANN001
    factories.cpu_host("home")
    with _serve({REPO: Repo(_files(), gated_token="hf_secret_for_the_test")}, hub_settings):
        model = _register(operator)
        row = _download(model)
        assert row.status == DownloadStatus.FAILED
        assert row.status_message == (
            f"download failed: {REPO} is gated: the hub refused this host without an access token (set "
            "GANTRY_HUB_TOKEN on the host, for an account that accepted the model's terms)"
        )
        model.delete()
        hub_settings.GANTRY_HUB_TOKEN = "hf_secret_for_the_test"
        row = _download(_register(operator))
    assert row.status == DownloadStatus.SUCCEEDED, row.status_message
    said = " ".join(Event.objects.values_list("message", flat=True))
    assert "hf_secret_for_the_test" not in said + row.status_message


def test_a_download_larger_than_the_free_disk_is_refused_before_a_byte_moves(hub_settings, operator):  # noqa: ANN001
    factories.cpu_host("home")
    repo = Repo(_files(), listed_sizes={"model.safetensors": 1 << 50})  # a petabyte, as the hub lists it
    with _serve({REPO: repo}, hub_settings) as server:
        row = _download(_register(operator))
    assert row.status == DownloadStatus.FAILED
    assert "not enough disk: tiny-org/tiny-embedder needs 1.0\xa0PB more in" in row.status_message
    assert "nothing was downloaded" in row.status_message
    assert not [p for m, p, _ in server.requests if "/resolve/" in p]


def test_a_cancel_stops_a_running_download_and_a_new_one_resumes_from_its_files(hub_settings, operator):  # noqa: ANN001
    factories.cpu_host("home")
    repo = Repo(_files(weights_bytes=LARGE))
    with _serve({REPO: repo}, hub_settings, rate_bps=8 * 1024 * 1024) as server:
        model = _register(operator)
        row = ModelDownload.objects.get(model=model)
        runner = threading.Thread(target=_download, args=(model,))
        runner.start()
        _until(lambda: ModelDownload.objects.get(pk=row.pk).bytes_done > 1024 * 1024)
        downloads.download_cancel(download_id=row.pk, user=operator)
        runner.join(30)
        connection.close()
        row.refresh_from_db()
        assert row.status == DownloadStatus.CANCELLED
        assert 0 < row.bytes_done < row.bytes_total
        # The first download is asked again on its host: it resumes from the partial file.
        server.rate_bps = 0
        downloads.download_request(model_id=model.pk, host="home", user=operator)
        row = _download(model)
    assert row.status == DownloadStatus.SUCCEEDED, row.status_message
    assert "/tiny-org/tiny-embedder/resolve/" in " ".join(server.ranged())
    model.refresh_from_db()
    assert model.inspection == Inspection.READY


def test_a_download_whose_worker_was_killed_resumes_from_its_partial_files(hub_settings, operator, tmp_path):  # noqa: ANN001
    factories.cpu_host("home")
    repo = Repo(_files(weights_bytes=LARGE))
    with _serve({REPO: repo}, hub_settings, rate_bps=8 * 1024 * 1024) as server:
        model = _register(operator)
        row = ModelDownload.objects.get(model=model)
        # The worker's own code, in a process of its own: killed with its whole group mid-download.
        code = f"import django; django.setup(); from workers import downloads; downloads.run_download({row.pk})"
        env = {**os.environ, "GANTRY_HUB_CACHE": str(hub_settings.GANTRY_HUB_CACHE), "GANTRY_HUB_ENDPOINT": server.url,
               "GANTRY_HOST_NAME": "home", "DJANGO_SETTINGS_MODULE": "controlplane.settings",
               "DATABASE_URL": _database_url()}  # fmt: skip
        dying = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)  # noqa: S603
        _until(lambda: ModelDownload.objects.get(pk=row.pk).bytes_done > 1024 * 1024)
        os.killpg(dying.pid, signal.SIGKILL)
        dying.wait()
        row.refresh_from_db()
        assert row.status == DownloadStatus.RUNNING and 0 < row.bytes_done < row.bytes_total
        server.rate_bps = 0
        row = _download(model)
    assert row.status == DownloadStatus.SUCCEEDED, row.status_message
    assert "/tiny-org/tiny-embedder/resolve/" in " ".join(server.ranged())  # it went on from where it stopped
    model.refresh_from_db()
    assert model.inspection == Inspection.READY
    assert (model.folder / "model.safetensors").read_bytes() == repo.files["model.safetensors"]


def _placed_on_both(operator) -> tuple[RegisteredModel, dict[str, Replica]]:  # noqa: ANN001
    """The hub model held by "home" only, and a deployment of two replicas spread over both hosts."""
    model = _register(operator)
    assert _download(model).status == DownloadStatus.SUCCEEDED
    deployment = deployments.deployment_create(
        name="d", hosts=[], placements=[PlacementSpec(model="tiny")], replicas=2, user=operator
    )
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    placed = {r.host.name: r for r in Replica.objects.select_related("host").filter(deployment=deployment)}
    return model, placed


def test_a_replica_placed_where_the_model_is_not_fetches_it_first_then_launches(hub_settings, operator):  # noqa: ANN001
    factories.cpu_host("home")
    factories.cpu_host("other")
    with _serve({REPO: Repo(_files())}, hub_settings):
        model, placed = _placed_on_both(operator)
        assert set(placed) == {"home", "other"}  # spread: the second goes where it must fetch the files
        hub_settings.GANTRY_HUB_CACHE = hub_settings.GANTRY_HUB_CACHE.parent / "other-hub"
        with override_settings(GANTRY_HOST_NAME="other"):
            assert lifecycle._start_server(placed["other"].pk) is None  # its launch task
        replica = Replica.objects.get(pk=placed["other"].pk)
        assert replica.status == DeploymentStatus.FETCHING
        download = ModelDownload.objects.get(model=model, host__name="other")
        assert download.status == DownloadStatus.PENDING
        assert f"(download {download.pk})" in Event.objects.filter(to_status="fetching").get().message
        downloads.download_progress(download_id=download.pk)  # not running yet: nothing said
        states.download_transition(download_id=download.pk, to=DownloadStatus.RUNNING, source="test")
        downloads.download_progress(download_id=download.pk, bytes_total=4 * MB, bytes_done=MB, rate_bps=MB)
        said = Replica.objects.get(pk=replica.pk).status_message
        assert said == f"fetching tiny (download {download.pk}): 25 %, 1.0\xa0MB of 4.0\xa0MB, 1.0\xa0MB/s, 3 s left"
        assert _download(model, "other").status == DownloadStatus.SUCCEEDED
    replica.refresh_from_db()
    assert replica.status == DeploymentStatus.LAUNCHING
    assert (
        Event.objects.filter(from_status="fetching", to_status="launching")
        .get()
        .message.endswith("tiny is here: starting its server")
    )
    assert CheckpointCopy.objects.get(model=model, host__name="other").matches
    with override_settings(GANTRY_HOST_NAME="other"):
        assert downloads.to_fetch(replica) == []  # its next launch starts the server


def test_a_replica_whose_fetch_fails_fails_with_the_reason(hub_settings, operator):  # noqa: ANN001
    factories.cpu_host("home")
    factories.cpu_host("other")
    repo = Repo(_files())
    with _serve({REPO: repo}, hub_settings):
        model, placed = _placed_on_both(operator)
        repo.corrupt.add("model.safetensors")
        hub_settings.GANTRY_HUB_CACHE = hub_settings.GANTRY_HUB_CACHE.parent / "other-hub"
        with override_settings(GANTRY_HOST_NAME="other"):
            lifecycle._start_server(placed["other"].pk)
        assert _download(model, "other").status == DownloadStatus.FAILED
    replica = Replica.objects.get(pk=placed["other"].pk)
    assert replica.status == DeploymentStatus.FAILED
    said = Event.objects.filter(from_status="fetching", to_status="failed").get().message
    assert "its host could not fetch tiny: 1 file(s) failed their hash and were removed: model.safetensors" in said


def test_registering_from_the_hub_is_validated_by_field(operator):  # noqa: ANN001
    factories.cpu_host("home")
    cases = [
        ({}, {"path": ["give a checkpoint folder, or a hub_id to download"]}),
        ({"hub_id": "not a repo"}, "hub_id"),
        ({"hub_id": "a/b/c"}, {"hub_id": ["must be a repository id, owner/name"]}),
        ({"path": "/models/x", "allow_patterns": ["*.json"]},
         {"allow_patterns": ["only for a model downloaded from the hub"]}),
        ({"hub_id": REPO, "ignore_patterns": [""]}, "ignore_patterns"),
    ]  # fmt: skip
    for fields, expected in cases:
        with pytest.raises(ValidationFailed) as refused:
            registered_models.model_register(name="m", kind="embedding", host="home", user=operator, **fields)
        if isinstance(expected, str):
            assert list(refused.value.errors) == [expected]
        else:
            assert refused.value.errors == expected
    assert not RegisteredModel.objects.exists() and not ModelDownload.objects.exists()


def _until(condition, timeout: float = 30) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _database_url() -> str:
    db = connection.settings_dict
    return f"postgres://{db['USER']}:{db['PASSWORD']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


def test_placement_prefers_a_host_that_holds_the_model(hub_settings, operator):  # noqa: ANN001
    factories.cpu_host("a-fetcher")  # first by name: it would win every tie
    factories.cpu_host("home")
    with _serve({REPO: Repo(_files())}, hub_settings):
        assert _download(_register(operator)).status == DownloadStatus.SUCCEEDED
    for policy in ("spread", "pack"):
        deployment = deployments.deployment_create(
            name=f"one-{policy}", hosts=[], placements=[PlacementSpec(model="tiny")], placement_policy=policy,
            user=operator,
        )  # fmt: skip
        deployments.deployment_start(deployment_id=deployment.pk, user=operator)
        assert [r.host.name for r in Replica.objects.filter(deployment=deployment)] == ["home"]


def test_a_download_whose_host_went_quiet_is_reaped_and_one_being_cancelled_ends_cancelled(hub_settings, operator):  # noqa: ANN001
    from datetime import timedelta

    from django.utils import timezone

    from deployments import states

    factories.cpu_host("home")
    factories.cpu_host("other")
    model = _register(operator)
    other = registered_models.model_register(name="two", kind="embedding", host="other", hub_id=REPO, user=operator)
    rows = [ModelDownload.objects.get(model=model), ModelDownload.objects.get(model=other)]
    for row in rows:
        states.download_transition(download_id=row.pk, to=DownloadStatus.RUNNING, source="test")
    downloads.download_cancel(download_id=rows[1].pk, user=operator)
    long_ago = timezone.now() - timedelta(seconds=hub_settings.GANTRY_BUILD_STALE_AFTER + 1)
    ModelDownload.objects.update(heartbeat_at=long_ago)
    assert sorted(downloads.downloads_reap()) == sorted(r.pk for r in rows)
    ended = {r.pk: (r.status, r.status_message) for r in ModelDownload.objects.all()}
    assert ended[rows[0].pk][0] == DownloadStatus.FAILED and "ask again to resume" in ended[rows[0].pk][1]
    assert ended[rows[1].pk][0] == DownloadStatus.CANCELLED and ended[rows[1].pk][1].startswith("cancelled (its host")
    assert downloads.downloads_reap() == []
    # A first download that failed leaves its model failed, saying why; a cancelled one may be asked again.
    failed, cancelled = (RegisteredModel.objects.get(pk=m.pk) for m in (model, other))
    assert failed.inspection == Inspection.FAILED and "ask again to resume" in failed.inspection_message
    assert cancelled.inspection == Inspection.PENDING


def test_the_relay_opens_a_download_only_to_its_own_host_signed_with_its_channel_key(hub_settings, operator):  # noqa: ANN001
    from common import pki
    from common.errors import NotFound, PermissionDenied
    from deployments import states
    from hosts.models import GpuHost
    from hosts.services import channel

    hosts = {name: factories.cpu_host(name) for name in ("home", "other")}
    keys = {name: pki.new_key() for name in hosts}
    for name, host in hosts.items():
        channel.host_certificate_issue(host, pki.request(keys[name], name))
    model = _register(operator)
    with _serve({REPO: Repo(_files())}, hub_settings):
        assert _download(model).status == DownloadStatus.SUCCEEDED
    model.refresh_from_db()
    fetching = downloads.download_request(model_id=model.pk, host="other", user=operator)

    def token(signer: str, download_id: int = fetching.pk) -> str:
        return f"{download_id}.{pki.prove(keys[signer], downloads.relay_token_text(download_id))}"

    for forged in (token("home"), f"{fetching.pk}.00", "", "x.y", token("other", download_id=fetching.pk + 1)):
        with pytest.raises(PermissionDenied):
            downloads.relay_for(token=forged)
    with pytest.raises(NotFound, match="no online host that holds tiny can be reached over its channel"):
        downloads.relay_for(token=token("other"))  # home holds it, but has no channel (loopback, no port)
    GpuHost.objects.filter(name="home").update(address="10.77.0.2", channel_port=17443)
    relay = downloads.relay_for(token=token("other"))
    assert relay.download == fetching and relay.holder.name == "home"
    states.download_transition(download_id=fetching.pk, to=DownloadStatus.CANCELLED, source="test")
    with pytest.raises(PermissionDenied, match="no active download has this token"):
        downloads.relay_for(token=token("other"))


def test_files_whose_names_look_like_globs_are_downloaded_as_named(hub_settings, operator):  # noqa: ANN001
    factories.cpu_host("home")
    files = {**_files(), "extra/b[1].bin": b"one", "extra/b1.bin": b"other", "x*.json": b"{}", "xy.json": b"{}"}
    with _serve({REPO: Repo(files)}, hub_settings):
        row = _download(_register(operator, ignore_patterns=["extra/b1.bin", "xy.json"]))
    assert row.status == DownloadStatus.SUCCEEDED, row.status_message
    snapshot = RegisteredModel.objects.get(name="tiny").folder
    assert (snapshot / "extra" / "b[1].bin").read_bytes() == b"one" and (snapshot / "x*.json").exists()
    assert not (snapshot / "extra" / "b1.bin").exists() and not (snapshot / "xy.json").exists()
