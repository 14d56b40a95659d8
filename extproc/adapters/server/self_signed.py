"""A self-signed serving certificate, made in memory at start: TLS on the ext_proc port without a
certificate to provide, as GIE's endpoint picker serves by default (``grpc.secure_serving``).

The gateways that implement InferencePool connect to the picker over TLS but do not verify its
certificate, so a certificate nobody signed still gives them an encrypted channel; give
``grpc.tls`` files (a mounted Secret, re-read when it changes) for one they can verify. Nothing is
written to disk: the key lives in this process only, and a restart makes a new one.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket

import grpc

VALID_DAYS = 365
SUBJECT = "extproc-endpoint-picker"


def self_signed_pair(hosts: tuple[str, ...] = ()) -> tuple[bytes, bytes]:
    """(certificate, private key) in PEM: an EC P-256 key, the certificate valid for
    :data:`VALID_DAYS` with ``localhost``, ``127.0.0.1``, this host's name and ``hosts`` as SANs."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(("localhost", "127.0.0.1", socket.gethostname(), *hosts)):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if host:
                names.append(x509.DNSName(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SUBJECT)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks a little behind still accept it
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def self_signed_credentials(hosts: tuple[str, ...] = ()) -> tuple[grpc.ServerCredentials, bytes]:
    """Server credentials with a new self-signed certificate, and that certificate (PEM)."""
    cert, key = self_signed_pair(hosts)
    return grpc.ssl_server_credentials([(key, cert)]), cert


def serves_self_signed(tls_given: bool, secure_serving: bool | None, discovery_type: str, listen: str) -> bool:
    """Whether the ext_proc port serves a self-signed certificate: no ``grpc.tls`` files, and
    ``grpc.secure_serving`` on, or unset while following an InferencePool (the picker's default,
    as GIE's). Never on a unix socket (it is the host's own)."""
    if tls_given or listen.startswith("unix:"):
        return False
    return secure_serving if secure_serving is not None else discovery_type == "inference_pool"
