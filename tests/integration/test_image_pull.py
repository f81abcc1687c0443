"""Images pulled on demand: a host pulls an allow-listed image it lacks from a
real registry (Debian's docker-registry, with a login) through the Docker
engine, with the credentials it holds for that registry, reporting progress;
`gantry check --install` takes the same path. Wrong or missing credentials
and an image not allow-listed are refused with the reason."""

from __future__ import annotations

import crypt
import io
import os
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from common.errors import PermanentError
from tests.integration.conftest import free_port, stop_process, wait_for
from workers import hostcheck
from workers.runtimes.docker import PullProgress, ensure_image, image_digests

pytestmark = [pytest.mark.integration]
USER, PASSWORD = "gantry-host", "registry-pass-for-the-test"
LAYER_BYTES = 8 * 1024 * 1024


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    """A registry on a loopback port that wants a login; its address."""
    port = free_port()
    (tmp_path / "htpasswd").write_text(f"{USER}:{crypt.crypt(PASSWORD, crypt.mksalt(crypt.METHOD_BLOWFISH))}\n")
    (tmp_path / "config.yml").write_text(
        f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path / 'data'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\nauth:\n  htpasswd:\n    realm: gantry-test\n"
        f"    path: {tmp_path / 'htpasswd'}\n"
    )
    log = (tmp_path / "registry.log").open("wb")
    server = subprocess.Popen(  # noqa: S603
        ["docker-registry", "serve", str(tmp_path / "config.yml")],  # noqa: S607
        stdout=log, stderr=log, start_new_session=True,
    )  # fmt: skip
    try:
        address = f"127.0.0.1:{port}"
        wait_for(lambda: _answers(address), 30, "the registry")
        yield address
    finally:
        stop_process(server)


def _answers(address: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(f"http://{address}/v2/", timeout=2)  # noqa: S310 - loopback
    except urllib.error.HTTPError as exc:
        return exc.code == 401  # up, and wanting a login
    except OSError:
        return False
    return False


@pytest.fixture
def pushed(registry: str) -> Iterator[str]:
    """An image of one layer (random bytes) pushed to the registry and gone from this host."""
    image = f"{registry}/gantry-test/pull-me:{uuid.uuid4().hex[:8]}"
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tarfile.TarInfo("payload.bin")
        info.size = LAYER_BYTES
        tar.addfile(info, io.BytesIO(os.urandom(LAYER_BYTES)))
    client = docker.from_env()
    repository, tag = image.rsplit(":", 1)
    try:
        client.api.import_image_from_data(layer.getvalue(), repository=repository, tag=tag)
        for event in client.api.push(repository, tag=tag, stream=True, decode=True,
                                     auth_config={"username": USER, "password": PASSWORD}):  # fmt: skip
            assert "error" not in event, event
        client.images.remove(image, force=True)
        assert not image_digests([image])
        yield image
    finally:
        try:
            client.images.remove(image, force=True)
        except docker.errors.NotFound:
            pass
        client.close()


def test_an_allow_listed_image_is_pulled_with_the_hosts_credentials_and_its_progress(pushed, registry, settings):  # noqa: ANN001
    settings.GANTRY_ALLOWED_IMAGES = [pushed]
    settings.GANTRY_REGISTRY_CREDENTIALS = {}
    with pytest.raises(
        PermanentError, match=rf"\({registry} wants credentials: give this host GANTRY_REGISTRY_CREDENTIALS"
    ):
        ensure_image(pushed)
    settings.GANTRY_REGISTRY_CREDENTIALS = {registry: {"username": USER, "password": "not-the-password"}}
    with pytest.raises(PermanentError) as refused:
        ensure_image(pushed)
    assert f"the credentials this host holds for {registry} in GANTRY_REGISTRY_CREDENTIALS were refused" in str(
        refused.value
    )
    assert "not-the-password" not in str(refused.value)

    settings.GANTRY_REGISTRY_CREDENTIALS = {registry: {"username": USER, "password": PASSWORD}}
    seen: list[PullProgress] = []
    assert ensure_image(pushed, seen.append) is True
    assert image_digests([pushed])
    assert seen and seen[-1].layers_done == seen[-1].layers == 1
    assert seen[-1].done == seen[-1].total >= LAYER_BYTES  # the compressed layer of random bytes
    assert any(0 < p.done < p.total for p in seen)  # progress came as it arrived
    assert seen[-1].words().startswith(f"pulling {pushed}: ")
    assert ensure_image(pushed) is False  # present: nothing to pull


def test_an_image_not_allow_listed_is_never_pulled(pushed, registry, settings):  # noqa: ANN001
    settings.GANTRY_ALLOWED_IMAGES = []
    settings.GANTRY_BUILDER_IMAGES = {}
    settings.GANTRY_REGISTRY_CREDENTIALS = {registry: {"username": USER, "password": PASSWORD}}
    with pytest.raises(PermanentError, match="is not on this host and not allow-listed: it is never pulled"):
        ensure_image(pushed)
    assert not image_digests([pushed])


def test_check_install_pulls_the_allow_listed_images_the_same_way(pushed, registry, settings):  # noqa: ANN001
    settings.GANTRY_ALLOWED_IMAGES = [pushed]
    settings.GANTRY_BUILDER_IMAGES = {}
    settings.GANTRY_REGISTRY_CREDENTIALS = {registry: {"username": USER, "password": PASSWORD}}
    assert hostcheck._install_images() == [f"pulled {pushed}"]
    assert image_digests([pushed])
