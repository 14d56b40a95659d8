"""Who may read and change routing through the admin API.

Reading (Explain, ListReplicas, ListHotKeys, GetSession, WatchDecisions, GetUsage, GetHitRatio) is open to whoever
reaches the listener, which is loopback unless configured otherwise. Changing (ForgetSession,
Cordon, Uncordon, Drain) needs one of: the bearer token from ``admin.token_file`` in the
``authorization`` metadata, or a client certificate on a mutual-TLS admin listener. With
neither configured, every mutation is refused: an admin port must never be a way to drain a
fleet by accident of network reach.

On an ext_proc port that is not loopback (the admin API shares it by default), reading needs
the token too (``reads_need_token``): whoever may reach Envoy's processor did not thereby get
to read its sessions and decisions. Without a token the admin API is not served there at all
(:func:`extproc.adapters.admin.server.place_admin`).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


class TokenFileError(ValueError):
    """The token file cannot be read or is empty."""


def read_token(path: str) -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped)."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise TokenFileError(f"admin.token_file {path}: {exc.strerror or exc}") from None
    if not token:
        raise TokenFileError(f"admin.token_file {path}: empty")
    return token


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a call may change routing, and if not, why."""

    allowed: bool
    refused_because: str = ""
    unauthenticated: bool = False


@dataclass(frozen=True, slots=True)
class MutationPolicy:
    """Decides on calls from their metadata."""

    token: str | None = None
    mutual_tls: bool = False
    reads_need_token: bool = False

    def check(self, metadata: Iterable[tuple[str, str | bytes]]) -> Verdict:
        """The verdict for a mutating call carrying ``metadata``."""
        if self.mutual_tls:
            return Verdict(True)  # the listener only accepts clients with a certificate the CA signed
        if self.token is None:
            return Verdict(False, "mutations are disabled: configure admin.token_file (or mTLS)")
        return self._bearer(metadata)

    def check_read(self, metadata: Iterable[tuple[str, str | bytes]]) -> Verdict:
        """The verdict for a reading call carrying ``metadata``."""
        if not self.reads_need_token:
            return Verdict(True)
        if self.token is None:  # not built so (place_admin), but never open by mistake
            return Verdict(False, "reading needs admin.token_file on this listener")
        return self._bearer(metadata)

    def _bearer(self, metadata: Iterable[tuple[str, str | bytes]]) -> Verdict:
        assert self.token is not None
        for key, value in metadata:
            if key.lower() == "authorization":
                text = value.decode() if isinstance(value, bytes) else value
                scheme, _, given = text.partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token.encode()):
                    return Verdict(True)
                return Verdict(False, "bad bearer token", unauthenticated=True)
        return Verdict(False, "a bearer token is needed (authorization: Bearer ...)", unauthenticated=True)
