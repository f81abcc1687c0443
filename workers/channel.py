"""A GPU host's channel: the one way another machine reaches its Triton servers.

Every Triton server binds loopback (triton_server.server.LOCAL). A host whose
address is not loopback runs this channel, started by its agent and outliving
a worker's restart as Triton servers do (``ensure_running``): a TLS 1.3
server on GANTRY_HOST_ADDRESS:GANTRY_CHANNEL_PORT that

- presents the host's certificate from Gantry's authority (common.pki), named
  for this host;
- accepts only a client certificate from the same authority made for the web
  tier (a host's certificate cannot be used as a client), and checks the
  authority's revocation list;
- forwards the connection to the Triton HTTP port the client named
  (``p<port>.h<host id>.gantry``), on loopback, and to nothing else: only the
  HTTP ports of this host's replicas are forwarded (the agent writes them
  down, ``allow``); a server's gRPC or metrics port, or any other program's
  port, is refused. Metrics are scraped on the host itself
  (workers.deploy.telemetry).

The host agent keeps the certificate (``keep_certificate``, every beat): it
leaves a certificate request on the host's row when it has none or two thirds
of its life are gone, signed with the current key for a renewal, and installs
what the control plane signs. The channel reads its files again when they
change, so a renewal or a new revocation list needs no restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import ssl
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from common import pki
from triton_server.server import LOCAL
from workers import processes

log = logging.getLogger(__name__)
KEY, CERT, TRUST, NEXT_KEY, PORTS = "key.pem", "cert.pem", "trust.pem", "next-key.pem", "ports"
# How often the channel looks at its files for a renewal or a new revocation list.
RELOAD_EVERY_S = 1.0
# A refused request is asked again after this long (the refusal is on the host's timeline).
ASK_AGAIN_S = 300.0
_BUFFER_HIGH = 256 * 1024


def folder() -> Path:
    """Where the host keeps its channel key, certificate and trust (mode 0700)."""
    path = Path(settings.GANTRY_DATA_DIR) / "channel"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)
    return path


def wanted() -> bool:
    """Whether this host runs a channel: any address but loopback."""
    return not pki.is_loopback(settings.GANTRY_HOST_ADDRESS)


def _write(path: Path, text: str) -> None:
    """``text`` in ``path`` (mode 0600), replaced in one rename; unchanged text is not written."""
    if path.exists() and path.read_text() == text:
        return
    partial = path.with_name(f".{path.name}.partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)
    os.replace(partial, path)


def install(place: Path, *, key: str, certificate: str, trust: str) -> None:
    """A key, its certificate and the authority's trust, as the channel reads them."""
    _write(place / TRUST, trust)
    _write(place / KEY, key)
    _write(place / CERT, certificate)


def installed(place: Path, host_id: int) -> tuple[pki.x509.Certificate, str] | None:
    """The certificate in ``place`` and its key, when they belong together, name
    host ``host_id`` and have not expired."""
    try:
        certificate = pki.load_cert((place / CERT).read_text())
        key = (place / KEY).read_text()
    except (OSError, ValueError):
        return None
    if pki.public_bytes(certificate) != pki.public_bytes(pki.load_key(key)) or pki.host_of(certificate) != host_id:
        return None
    if pki.not_after(certificate) <= timezone.now():
        return None
    return certificate, key


_asked: dict[bytes, float] = {}  # when each pending key was last asked for


def keep_certificate(host_id: int) -> None:
    """The host agent's part, once a beat: the trust file follows the authority's
    revocation list; a certificate is asked for when there is none or it is due
    for renewal, and installed once signed. The host's row says where its
    channel listens (0 while it has no certificate, on loopback, or once revoked)."""
    from hosts.models import GpuHost

    port = _keep(host_id)
    GpuHost.objects.filter(pk=host_id).exclude(channel_port=port).update(channel_port=port)
    allow(host_id)


def allow(host_id: int) -> None:
    """Write down the HTTP ports of this host's replicas, and its hub cache's file
    server (workers.hubfiles): all the channel forwards to (every beat, and before
    a server starts)."""
    from deployments.models import Replica

    if not wanted():
        return
    ports = sorted(Replica.objects.filter(host_id=host_id).values_list("http_port", flat=True))
    if settings.GANTRY_HUB_FILES_PORT:
        ports.append(settings.GANTRY_HUB_FILES_PORT)  # the hub cache's files, for the control plane's relay
    _write(folder() / PORTS, "".join(f"{port}\n" for port in ports))


def _keep(host_id: int) -> int:
    from hosts.models import ChannelAuthority, ChannelCertificate, GpuHost

    if not wanted():
        return 0
    place = folder()
    authority = ChannelAuthority.objects.filter(pk=1).first()
    if authority is not None:
        _write(place / TRUST, authority.certificate + authority.revocation_list)
    host = GpuHost.objects.get(pk=host_id)
    if host.channel_revoked:
        return 0
    current = installed(place, host_id)
    if current is not None and not pki.renewal_due(current[0], timezone.now()):
        return settings.GANTRY_CHANNEL_PORT
    if not (place / NEXT_KEY).exists():
        _write(place / NEXT_KEY, pki.key_pem(pki.new_key()))
    next_key = pki.load_key((place / NEXT_KEY).read_text())
    for row in ChannelCertificate.objects.filter(host_id=host_id, revoked_at=None).order_by("-created_at")[:3]:
        if authority is not None and pki.public_bytes(pki.load_cert(row.certificate)) == pki.public_bytes(next_key):
            install(place, key=pki.key_pem(next_key), certificate=row.certificate, trust=(place / TRUST).read_text())
            (place / NEXT_KEY).unlink()
            log.info("channel certificate %s installed, valid until %s", row.serial, row.not_after)
            return settings.GANTRY_CHANNEL_PORT
    asked = pki.public_bytes(next_key)  # (a request's signature differs every time it is made)
    if not host.channel_request and time.monotonic() - _asked.get(asked, -ASK_AGAIN_S) >= ASK_AGAIN_S:
        request = pki.request(next_key, host.name)
        proof = pki.prove(pki.load_key(current[1]), request) if current is not None else ""
        GpuHost.objects.filter(pk=host_id, channel_request="").update(channel_request=request, channel_proof=proof)
        _asked[asked] = time.monotonic()
    return settings.GANTRY_CHANNEL_PORT if current is not None else 0


# --- the channel itself ---------------------------------------------------------------


@dataclass
class Rules:
    """What the channel forwards: connections for ``host_id``'s replicas' HTTP ports."""

    host_id: int = 0
    ports: frozenset[int] = frozenset()

    def port_for(self, server_name: str | None) -> int | None:
        parsed = pki.parse_server_name(server_name or "")
        if parsed is None or parsed[0] != self.host_id or parsed[1] not in self.ports:
            return None
        return parsed[1]


def _ports(place: Path) -> frozenset[int]:
    try:
        return frozenset(int(line) for line in (place / PORTS).read_text().split())
    except (OSError, ValueError):
        return frozenset()


class _Pipe(asyncio.Protocol):
    """One side of a forwarded connection; writes what it reads to its peer, and
    stops reading while the peer cannot keep up."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None
        self.early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(high=_BUFFER_HIGH)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.write(data)
        else:
            self.early.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        # (An end of input closes this side, as asyncio does by default; TLS has no
        # half-close. Closing the peer sends what it still buffers first.)
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


class _Client(_Pipe):
    """The web tier's side, after the TLS handshake: the server it named is
    connected to on loopback, or the connection is closed."""

    def __init__(self, rules: Rules) -> None:
        super().__init__()
        self.rules = rules

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        ssl_object = transport.get_extra_info("ssl_object")
        port = self.rules.port_for(getattr(ssl_object, "gantry_server_name", None))
        if port is None:
            transport.close()
            return
        transport.pause_reading()  # until the server is connected
        asyncio.get_running_loop().create_task(self._connect(port))

    async def _connect(self, port: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, server = await loop.create_connection(_Pipe, LOCAL, port)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        assert isinstance(server, _Pipe)
        server.peer, self.peer = self, server
        if self.transport is None or self.transport.is_closing():
            server.transport.close()  # type: ignore[union-attr]
            return
        for data in self.early:
            server.transport.write(data)  # type: ignore[union-attr]
        self.early.clear()
        self.transport.resume_reading()


def _remember_name(ssl_object: ssl.SSLObject, name: str | None, _context: ssl.SSLContext) -> None:
    ssl_object.gantry_server_name = name  # type: ignore[attr-defined]


def server_context(place: Path) -> tuple[ssl.SSLContext, int]:
    """The channel's TLS context from its files, and the host id its certificate names."""
    host_id = pki.host_of(pki.load_cert((place / CERT).read_text()))
    if host_id is None:
        raise ValueError(f"{place / CERT} names no host")
    made = pki.context(
        server=True,
        key=(place / KEY).read_text(),
        certificate=(place / CERT).read_text(),
        trust=(place / TRUST).read_text(),
    )
    made.sni_callback = _remember_name
    return made, host_id


def _stamp(place: Path) -> tuple[float, ...]:
    return tuple((place / name).stat().st_mtime_ns if (place / name).exists() else 0 for name in (KEY, CERT, TRUST))


async def serve(address: str, port: int, place: Path) -> None:
    """Listen until cancelled; a change of the files starts a listener with the
    new context before the old one closes (connections already open stay).
    The ports it forwards to are read again every RELOAD_EVERY_S."""
    loop = asyncio.get_running_loop()
    listener: asyncio.AbstractServer | None = None
    seen: tuple[float, ...] = ()
    rules = Rules()
    try:
        while True:
            rules.ports = _ports(place)
            stamp = _stamp(place)
            if stamp != seen and all(stamp):
                try:
                    context, rules.host_id = server_context(place)
                except (OSError, ValueError, ssl.SSLError) as exc:
                    log.warning("channel: the certificate files are not usable yet: %s", exc)
                else:
                    fresh = await loop.create_server(
                        lambda: _Client(rules), address, port, ssl=context, reuse_port=True, ssl_handshake_timeout=10
                    )
                    if listener is not None:
                        listener.close()
                    listener = fresh
                    log.info("channel: listening on %s:%s for host %s", address, port, rules.host_id)
                    seen = stamp
            await asyncio.sleep(RELOAD_EVERY_S)
    finally:
        if listener is not None:
            listener.close()


def argv() -> list[str]:
    """The channel's command line under this host's settings."""
    return [sys.executable, "-m", "workers.channel", settings.GANTRY_HOST_ADDRESS, str(settings.GANTRY_CHANNEL_PORT)]


def ensure_running() -> None:
    """Start the channel unless it runs under these settings (the host agent,
    every beat). It runs in its own session and working folder, as Triton
    servers do, so a worker's restart or crash does not cut serving, and a new
    worker finds it there (a channel under other settings is replaced)."""
    if not wanted():
        return
    place, wanted_argv = folder(), argv()
    running = processes.working_in(place)
    for pid in running:
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1] == [a.encode() for a in wanted_argv]:
                return
        except OSError:
            continue
    for pid in running:
        processes.terminate_group(os.getpgid(pid), grace_s=5)
    code = Path(__file__).resolve().parents[1]
    # Only what it needs: no database, broker or secret key (processes.child_environment).
    env = processes.child_environment({"PYTHONPATH": str(code)})
    with open(Path(settings.GANTRY_DATA_DIR) / "channel.log", "ab") as log_file:
        started = processes.start_group(wanted_argv, env=env, cwd=place, stdout=log_file)
    log.info("channel started (pid %s) on %s:%s", started.pid, *wanted_argv[3:5])


def stop_under(data_dir: Path) -> None:
    """Stop the channel of the host whose data folder is ``data_dir`` (tests, a host's removal)."""
    for pid in processes.working_in(data_dir / "channel"):
        with contextlib.suppress(ProcessLookupError):
            processes.terminate_group(os.getpgid(pid), grace_s=5)


def main(arguments: list[str]) -> int:
    """The channel process: ``ADDRESS PORT``, in its folder, until SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    address, port = arguments
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

    async def run() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for number in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(number, task.cancel)  # type: ignore[union-attr]
        with contextlib.suppress(asyncio.CancelledError):
            await serve(address, int(port), Path.cwd())

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
