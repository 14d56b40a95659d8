"""Throwaway certificates for loopback TLS in tests: a CA and a server certificate for
127.0.0.1 and localhost, made with the ``openssl`` command (no Python dependency)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CertificateSet:
    """PEM files: the CA, and a certificate with its key signed by it."""

    ca_file: Path
    cert_file: Path
    key_file: Path


def _openssl(*args: str, cwd: Path) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        raise FileNotFoundError("openssl not found (Debian package openssl)")
    subprocess.run([binary, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(directory: Path, name: str = "server") -> CertificateSet:
    """A fresh CA and a server certificate (SAN IP 127.0.0.1, DNS localhost) under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca = directory / "ca.key", directory / "ca.pem"
    key, csr, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.pem"
    ext = directory / f"{name}.ext"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=extproc test CA",
             "-keyout", str(ca_key), "-out", str(ca), cwd=directory)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(csr),
             cwd=directory)  # fmt: skip
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
             "-days", "2", "-extfile", str(ext), "-out", str(cert), cwd=directory)  # fmt: skip
    return CertificateSet(ca, cert, key)
