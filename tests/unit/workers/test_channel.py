"""The channel to a host's Triton servers, for real on loopback: certificates
from Gantry's authority asked for by the agent and signed by the sweep,
renewal proven with the current key, revocation, and the TLS proxy itself
(a real TLS server forwarding to a real HTTP server), driven by the web
tier's own client context through aiohttp."""

from __future__ import annotations

import asyncio
import http.server
import socket
import ssl
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import aiohttp
import pytest
from django.utils import timezone

from common import pki
from core.models import Event
from hosts.models import ChannelCertificate, GpuHost
from hosts.services import channel as authority
from hosts.services.host_join import host_credentials_revoke
from tests import factories
from workers import channel

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def remote(settings, tmp_path: Path) -> GpuHost:  # noqa: ANN001
    settings.GANTRY_DATA_DIR = str(tmp_path)
    settings.GANTRY_HOST_ADDRESS = "10.0.0.2"
    settings.GANTRY_CHANNEL_PORT = 17443
    host = factories.cpu_host("far-host")
    GpuHost.objects.filter(pk=host.pk).update(address="10.0.0.2")
    authority._client = authority._ClientContext()  # no context cached from another test's authority
    return host


def _row(host: GpuHost) -> GpuHost:
    return GpuHost.objects.get(pk=host.pk)


def _signed(host: GpuHost) -> None:
    """One beat asks, the sweep signs, the next beat installs."""
    channel.keep_certificate(host.pk)
    assert _row(host).channel_request.startswith("-----BEGIN CERTIFICATE REQUEST")
    assert authority.channel_requests_sign() == 1
    channel.keep_certificate(host.pk)


def test_a_host_asks_for_its_first_certificate_and_installs_what_the_sweep_signs(remote: GpuHost) -> None:
    channel.keep_certificate(remote.pk)
    assert _row(remote).channel_port == 0  # nothing installed yet: the web tier does not try it
    assert authority.channel_requests_sign() == 1
    channel.keep_certificate(remote.pk)
    place = channel.folder()
    assert _row(remote).channel_port == 17443 and _row(remote).channel_request == ""
    assert oct(place.stat().st_mode & 0o777) == "0o700"
    assert {oct((place / n).stat().st_mode & 0o777) for n in ("key.pem", "cert.pem", "trust.pem")} == {"0o600"}
    certificate, _ = channel.installed(place, remote.pk)
    assert certificate.extensions.get_extension_for_class(pki.x509.SubjectAlternativeName).value.get_values_for_type(
        pki.x509.DNSName
    ) == [f"*.h{remote.pk}.gantry"]
    assert "its first" in Event.objects.get(kind="host.certificate", host=remote).message
    # Nothing more to ask for until two thirds of its life are gone.
    channel.keep_certificate(remote.pk)
    assert _row(remote).channel_request == ""


def test_a_renewal_is_proven_with_the_current_key_and_a_bare_request_is_refused(remote: GpuHost) -> None:
    _signed(remote)
    place = channel.folder()
    first, key = channel.installed(place, remote.pk)
    # Age the installed certificate: the same key, signed 21 of its 24 hours ago.
    row, secrets = authority.authority()
    aged = pki.issue(
        authority_key=pki.load_key(secrets.authority_key), authority=pki.load_cert(row.certificate),
        public=pki.load_request(pki.request(pki.load_key(key), remote.name)), common=remote.name,
        now=timezone.now() - timedelta(hours=21), lifetime=timedelta(hours=24), host_id=remote.pk,
    )  # fmt: skip
    ChannelCertificate.objects.create(
        host=remote, serial=f"{aged.serial_number:x}", certificate=pki.cert_pem(aged), not_after=pki.not_after(aged)
    )
    (place / "cert.pem").write_text(pki.cert_pem(aged))
    channel.keep_certificate(remote.pk)
    asked = _row(remote)
    assert asked.channel_request and asked.channel_proof  # signed with the key of the current certificate
    assert _row(remote).channel_port == 17443  # the aged certificate still serves meanwhile
    assert authority.channel_requests_sign() == 1
    channel.keep_certificate(remote.pk)
    renewed, new_key = channel.installed(place, remote.pk)
    assert renewed.serial_number not in (first.serial_number, aged.serial_number) and new_key != key
    assert "a renewal" in Event.objects.filter(kind="host.certificate").order_by("pk").last().message

    # Someone with the host's database role but not its key asks for one: refused, on the timeline.
    GpuHost.objects.filter(pk=remote.pk).update(channel_request=pki.request(pki.new_key(), remote.name))
    assert authority.channel_requests_sign() == 0
    refusal = Event.objects.get(kind="host.certificate_refused", host=remote).message
    assert "not signed with the key of its current certificate" in refusal


def test_revoking_a_host_revokes_its_certificates_and_no_new_one_is_signed(remote: GpuHost) -> None:
    _signed(remote)
    assert host_credentials_revoke(user=None, host_name=remote.name) == 1
    row = _row(remote)
    assert row.channel_revoked and row.channel_port == 0
    assert ChannelCertificate.objects.get(host=remote).revoked_at is not None
    channel.keep_certificate(remote.pk)
    assert _row(remote).channel_port == 0 and _row(remote).channel_request == ""
    serial = int(ChannelCertificate.objects.get(host=remote).serial, 16)
    crl = pki.x509.load_pem_x509_crl(authority.authority()[0].revocation_list.encode())
    assert crl.get_revoked_certificate_by_serial_number(serial) is not None
    assert authority.authority()[0].revocation_list in (channel.folder() / "trust.pem").read_text()  # the host has it
    # Its agent's next request is refused, on its timeline.
    GpuHost.objects.filter(pk=remote.pk).update(channel_request=pki.request(pki.new_key(), remote.name))
    assert authority.channel_requests_sign() == 0
    assert "joins again" in Event.objects.get(kind="host.certificate_refused", host=remote).message


# --- the channel's TLS proxy ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class _Answer(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        body = f"triton on {self.server.server_address[1]}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _http_server() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture
def triton() -> Iterator[int]:
    """A plain HTTP server on loopback standing in for a Triton HTTP port."""
    yield from _http_server()


@pytest.fixture
def stranger() -> Iterator[int]:
    """Another program's HTTP server on loopback, answering anyone who reaches it."""
    yield from _http_server()


class _Channel:
    """workers.channel.serve on its own event loop, in a thread."""

    def __init__(self, place: Path) -> None:
        self.port = _free_port()
        self.loop = asyncio.new_event_loop()
        self.task: asyncio.Task | None = None
        self.thread = threading.Thread(target=self._run, args=(place,), daemon=True)
        self.thread.start()

    def _run(self, place: Path) -> None:
        asyncio.set_event_loop(self.loop)
        self.task = self.loop.create_task(channel.serve("127.0.0.1", self.port, place))
        try:
            self.loop.run_until_complete(self.task)
        except asyncio.CancelledError:
            pass

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(10)


def _get(port: int, server_name: str, context: ssl.SSLContext) -> tuple[int, str]:
    """GET / through the channel, as the web tier does: the status and the body."""

    async def run() -> tuple[int, str]:
        async with aiohttp.ClientSession() as session:
            url = f"https://127.0.0.1:{port}/"
            async with session.get(url, ssl=context, server_hostname=server_name) as answer:
                return answer.status, await answer.text()

    return asyncio.run(run())


def _served(port: int, server_name: str, context: ssl.SSLContext) -> int:
    """The serial of the certificate the channel presents."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname=server_name) as tls:
            return pki.x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def _refused(port: int, server_name: str, context: ssl.SSLContext) -> str:
    try:
        _get(port, server_name, context)
    except (aiohttp.ClientError, ssl.SSLError, OSError) as exc:
        return type(exc).__name__
    raise AssertionError(f"{server_name} answered")


def test_the_channel_forwards_only_the_web_tiers_requests_for_triton_http_ports(
    remote: GpuHost, triton: int, stranger: int
) -> None:
    _signed(remote)
    place = channel.folder()
    (place / "ports").write_text(f"{triton}\n")  # as allow() writes this host's replicas' HTTP ports
    running = _Channel(place)
    try:
        client = authority.client_context()
        name = pki.server_name(remote.pk, triton)
        _wait(lambda: _answers(running.port, name, client))
        status, body = _get(running.port, name, client)
        assert (status, body) == (200, f"triton on {triton}")
        # Another program's port, answering on loopback, is not forwarded to (nor a server's
        # gRPC port); nor is a name for another host, even from a client that skips its
        # own name check.
        _, key, certificate = authority.client_certificate()
        unchecked = pki.context(server=False, key=key, certificate=certificate, trust=(place / "trust.pem").read_text())
        unchecked.check_hostname = False
        for other in (pki.server_name(remote.pk, stranger), pki.server_name(remote.pk, triton + 1),
                      pki.server_name(remote.pk + 1, triton)):  # fmt: skip
            assert _refused(running.port, other, unchecked)
        # No client certificate, or a host's certificate as the client: the handshake fails.
        bare = ssl.create_default_context(cafile=str(place / "trust.pem"))
        bare.check_hostname = False
        assert _refused(running.port, name, bare)
        as_host = pki.context(
            server=False, key=(place / "key.pem").read_text(), certificate=(place / "cert.pem").read_text(),
            trust=(place / "trust.pem").read_text(),
        )  # fmt: skip
        as_host.check_hostname = False
        assert _refused(running.port, name, as_host)
        # The web tier checks the name: this host's certificate does not pass for another host.
        with socket.create_connection(("127.0.0.1", running.port), timeout=5) as raw:
            with pytest.raises(ssl.SSLCertVerificationError):
                client.wrap_socket(raw, server_hostname=pki.server_name(remote.pk + 1, triton))
    finally:
        running.stop()


def test_a_renewed_certificate_is_served_without_a_restart_and_a_revoked_host_is_refused(
    remote: GpuHost, triton: int
) -> None:
    _signed(remote)
    place = channel.folder()
    (place / "ports").write_text(f"{triton}\n")
    running = _Channel(place)
    try:
        name = pki.server_name(remote.pk, triton)
        _wait(lambda: _answers(running.port, name, authority.client_context()))
        first = _served(running.port, name, authority.client_context())
        # A renewal lands in the files: the channel serves it, still running.
        row, secrets = authority.authority()
        key = pki.new_key()
        renewed = authority._sign(pki.load_request(pki.request(key, remote.name)), common=remote.name, host=remote)
        channel.install(place, key=pki.key_pem(key), certificate=renewed.certificate, trust=authority.trust_pem(row))
        _wait(lambda: _served(running.port, name, authority.client_context()) == int(renewed.serial, 16))
        assert first != int(renewed.serial, 16)

        host_credentials_revoke(user=None, host_name=remote.name)
        authority._client = authority._ClientContext()  # as a web process would within CONTEXT_TTL_S
        reason = _refused(running.port, name, authority.client_context())
        assert reason == "ClientConnectorCertificateError"
    finally:
        running.stop()


def _answers(port: int, name: str, context: ssl.SSLContext) -> bool:
    try:
        return _get(port, name, context)[0] == 200
    except (aiohttp.ClientError, ssl.SSLError, OSError):
        return False


def _wait(predicate, timeout_s: float = 10) -> None:  # noqa: ANN001
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_refused_request_is_not_asked_again_every_beat(remote: GpuHost) -> None:
    _signed(remote)
    ChannelCertificate.objects.filter(host=remote).update(not_after=timezone.now() - timedelta(minutes=1))
    (channel.folder() / "cert.pem").unlink()  # as if it expired on the host too
    channel.keep_certificate(remote.pk)
    assert _row(remote).channel_request  # asked...
    assert authority.channel_requests_sign() == 0  # ...and refused: an expired host joins again
    assert "expired" in Event.objects.get(kind="host.certificate_refused", host=remote).message
    for _ in range(3):
        channel.keep_certificate(remote.pk)
    assert _row(remote).channel_request == "" and _row(remote).channel_port == 0
