"""TLS and mutual TLS for the gRPC listener, with certificates reloaded when their files change.

The listener is plaintext on loopback by default (Envoy in the same pod or host dials
127.0.0.1:9002 or a unix socket). When Envoy runs elsewhere, ``grpc.tls`` (``--tls-cert``,
``--tls-key``, ``--tls-client-ca``) makes it TLS, and with a client CA mutual TLS: the handshake
fails for a client without a certificate that CA signed, before any ext_proc message is read.

Certificates are read from files (cert-manager or a mounted Secret): gRPC asks
:class:`CertificateFiles` before each new handshake, and the files are read again when their
size or modification time changed, so a rotated certificate is served to new connections without
a restart. Swap the files in with a rename (as Kubernetes does for a mounted Secret): a rotation
caught half-way (a new key beside the old certificate) can fail the handshakes made in between,
until the next change of the files is read. A file that cannot be read, or holds no PEM, keeps
the previous certificate.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Generic, TypeVar

import grpc

from extproc.config import ListenerTls

log = logging.getLogger("extproc.adapters.server")
T = TypeVar("T")


def read_pem(path: str, field: str) -> bytes:
    """The PEM file at ``path``; ValueError naming ``grpc.tls.<field>`` if unreadable or not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"grpc.tls.{field}: cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"grpc.tls.{field}: {path} holds no PEM block")
    return data


class WatchedFiles(Generic[T]):
    """The listener's certificate, key and client CA as the server takes them (:meth:`_load`),
    read again when one of the files changes."""

    def __init__(self, tls: ListenerTls) -> None:
        self.tls = tls
        self._paths = [p for p in (tls.cert_file, tls.key_file, tls.client_ca_file) if p]
        self._stamp = self._stamps()
        self.configuration = self._load()
        self.reloads = 0

    def _stamps(self) -> tuple[tuple[int, int], ...]:
        out = []
        for path in self._paths:
            try:
                st = os.stat(path)
                out.append((st.st_mtime_ns, st.st_size))
            except OSError:
                out.append((-1, -1))
        return tuple(out)

    def _load(self) -> T:
        raise NotImplementedError

    def __call__(self) -> T | None:
        """A new configuration when the files changed, else None (keep the current).

        Called before each handshake (from gRPC's own threads, or OpenSSL's callback), so it
        must never raise."""
        stamp = self._stamps()
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        try:
            self.configuration = self._load()
        except ValueError as exc:
            log.warning("TLS certificate files changed but cannot be used yet (%s); keeping the previous ones", exc)
            return None
        self.reloads += 1
        log.info("TLS certificate files changed: serving the new certificate to new connections")
        return self.configuration


class CertificateFiles(WatchedFiles[grpc.ServerCertificateConfiguration]):
    """The files as grpcio's certificate configuration; the instance is gRPC's fetcher."""

    def _load(self) -> grpc.ServerCertificateConfiguration:
        tls = self.tls
        pair = (read_pem(tls.key_file, "key_file"), read_pem(tls.cert_file, "cert_file"))
        ca = read_pem(tls.client_ca_file, "client_ca_file") if tls.client_ca_file else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)


def server_credentials(tls: ListenerTls) -> tuple[grpc.ServerCredentials, CertificateFiles]:
    """Credentials for ``add_secure_port``; raises ValueError naming the field for a bad file."""
    files = CertificateFiles(tls)
    credentials = grpc.dynamic_ssl_server_credentials(
        files.configuration, files, require_client_authentication=tls.mutual
    )
    return credentials, files
