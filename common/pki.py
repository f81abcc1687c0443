"""The channel's certificates: Gantry's own certificate authority signs one
certificate per GPU host (a TLS server, named for the host) and one for the
web tier (a TLS client); a revocation list signed by the same authority cuts
either off. Pure cryptography, no Django: the control plane
(hosts.services.channel) and the host (workers.channel) share it.

Names: a host's certificate is valid for ``*.h<host id>.gantry``, and the web
tier asks for ``p<port>.h<host id>.gantry`` (TLS server name indication): the
host's channel forwards the connection to that Triton port on its loopback,
and the client's hostname check makes sure it reached the host it meant.
"""

from __future__ import annotations

import ipaddress
import os
import re
import ssl
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SUFFIX = "gantry"
_SERVER_NAME = re.compile(rf"^p(\d{{1,5}})\.h(\d{{1,18}})\.{SUFFIX}$")
# How long a revocation list is valid: it is signed again long before (every
# revocation, and by the sweep when half of it is gone).
CRL_DAYS = 30
_CURVE = ec.SECP256R1()


class BadRequest(ValueError):
    """A certificate request that cannot be signed; the message says why."""


def is_loopback(address: str) -> bool:
    """Whether a host's address (GANTRY_HOST_ADDRESS) is loopback: a host on the
    control plane's own machine, whose servers are reached there, with no channel."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def server_name(host_id: int, port: int) -> str:
    """What the web tier asks a host's channel for: Triton's ``port`` on host ``host_id``."""
    return f"p{port}.h{host_id}.{SUFFIX}"


def parse_server_name(name: str) -> tuple[int, int] | None:
    """(host id, port) of a server name, or None for any other name."""
    match = _SERVER_NAME.match(name or "")
    return (int(match.group(2)), int(match.group(1))) if match else None


def host_of(certificate: x509.Certificate) -> int | None:
    """The host id a host's certificate names (``*.h<id>.gantry``), or None."""
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    for name in names.get_values_for_type(x509.DNSName):
        match = re.match(rf"^\*\.h(\d{{1,18}})\.{SUFFIX}$", name)
        if match:
            return int(match.group(1))
    return None


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(_CURVE)


def key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def load_key(pem: str) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(pem.encode(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("not an elliptic-curve key")
    return key


def cert_pem(certificate: x509.Certificate | x509.CertificateRevocationList) -> str:
    return certificate.public_bytes(serialization.Encoding.PEM).decode()


def load_cert(pem: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem.encode())


def public_bytes(key: ec.EllipticCurvePrivateKey | x509.Certificate | x509.CertificateSigningRequest) -> bytes:
    """The DER of a key's, certificate's or request's public key: what says two belong together."""
    public = key.public_key()
    return public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _name(common: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Gantry"), x509.NameAttribute(NameOID.COMMON_NAME, common)]
    )


def new_authority(now: datetime, years: int = 10) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = new_key()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(_name("Gantry channel authority"))
        .issuer_name(_name("Gantry channel authority"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=365 * years))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, certificate


def request(key: ec.EllipticCurvePrivateKey, common: str) -> str:
    """A certificate request (PEM) for ``key``; the authority sets the name it signs."""
    built = x509.CertificateSigningRequestBuilder().subject_name(_name(common)).sign(key, hashes.SHA256())
    return built.public_bytes(serialization.Encoding.PEM).decode()


def load_request(pem: str) -> x509.CertificateSigningRequest:
    """A certificate request whose signature holds (its sender has the key), else BadRequest."""
    try:
        loaded = x509.load_pem_x509_csr(pem.encode())
    except ValueError as exc:
        raise BadRequest(f"not a PEM certificate request: {exc}") from None
    if not loaded.is_signature_valid:
        raise BadRequest("the certificate request's signature does not hold")
    if not isinstance(loaded.public_key(), ec.EllipticCurvePublicKey):
        raise BadRequest("the certificate request's key must be an elliptic-curve (P-256) key")
    return loaded


def prove(key: ec.EllipticCurvePrivateKey, request_pem: str) -> str:
    """``request_pem`` signed by ``key`` (hex): a renewal is asked for by the holder of the current key."""
    return key.sign(request_pem.encode(), ec.ECDSA(hashes.SHA256())).hex()


def proven(certificate: x509.Certificate, request_pem: str, proof: str) -> bool:
    public = certificate.public_key()
    try:
        public.verify(bytes.fromhex(proof), request_pem.encode(), ec.ECDSA(hashes.SHA256()))  # type: ignore[union-attr]
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def issue(
    *,
    authority_key: ec.EllipticCurvePrivateKey,
    authority: x509.Certificate,
    public: x509.CertificateSigningRequest,
    common: str,
    now: datetime,
    lifetime: timedelta,
    host_id: int | None,
) -> x509.Certificate:
    """A certificate for the request's key: a host's (TLS server, ``*.h<id>.gantry``)
    when ``host_id`` is given, else the web tier's (TLS client)."""
    usage = ExtendedKeyUsageOID.SERVER_AUTH if host_id is not None else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(authority.subject)
        .public_key(public.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(authority_key.public_key()), critical=False)
    )
    if host_id is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(f"*.h{host_id}.{SUFFIX}")]), critical=False
        )
    return builder.sign(authority_key, hashes.SHA256())


def revocation_list(
    *,
    authority_key: ec.EllipticCurvePrivateKey,
    authority: x509.Certificate,
    serials: list[int],
    number: int,
    now: datetime,
) -> x509.CertificateRevocationList:
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(authority.subject)
        .last_update(now - timedelta(minutes=5))
        .next_update(now + timedelta(days=CRL_DAYS))
        .add_extension(x509.CRLNumber(number), critical=False)
    )
    for serial in serials:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
        )
    return builder.sign(authority_key, hashes.SHA256())


def not_after(certificate: x509.Certificate) -> datetime:
    return certificate.not_valid_after_utc


def renewal_due(certificate: x509.Certificate, now: datetime) -> bool:
    """A certificate is renewed once two thirds of its life are gone."""
    start, end = certificate.not_valid_before_utc, certificate.not_valid_after_utc
    return now >= start + (end - start) * 2 / 3


def context(*, server: bool, key: str, certificate: str, trust: str) -> ssl.SSLContext:
    """A TLS 1.3 context that presents ``certificate`` and verifies the peer's
    against ``trust`` (the authority and its revocation list, PEM). Python
    loads keys and revocation lists only from files: they pass through a
    private temporary folder, removed before this returns."""
    made = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    made.minimum_version = ssl.TLSVersion.TLSv1_3
    made.verify_mode = ssl.CERT_REQUIRED
    made.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    with tempfile.TemporaryDirectory(prefix="gantry-tls-") as folder:
        paths = {}
        for name, text in (("key", key), ("cert", certificate), ("trust", trust)):
            path = Path(folder) / name
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as handle:
                handle.write(text)
            paths[name] = str(path)
        made.load_cert_chain(paths["cert"], paths["key"])
        made.load_verify_locations(cafile=paths["trust"])
    return made


def utcnow() -> datetime:
    return datetime.now(timezone.utc)
