"""Who may change routing through the admin API.

Reading (Explain, ListReplicas, GetSession, WatchDecisions) is open to whoever reaches the
listener, which is loopback unless configured otherwise. Changing (ForgetSession, Cordon,
Uncordon, Drain) needs one of: the bearer token from ``admin.token_file`` in the
``authorization`` metadata, or a client certificate on a mutual-TLS listener. With neither
configured, every mutation is refused: an admin port must never be a way to drain a fleet by
accident of network reach.
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
    """Decides on mutating calls from their metadata."""

    token: str | None = None
    mutual_tls: bool = False

    def check(self, metadata: Iterable[tuple[str, str | bytes]]) -> Verdict:
        """The verdict for a call carrying ``metadata``."""
        if self.mutual_tls:
            return Verdict(True)  # the listener only accepts clients with a certificate the CA signed
        if self.token is None:
            return Verdict(False, "mutations are disabled: configure admin.token_file (or mTLS)")
        for key, value in metadata:
            if key.lower() == "authorization":
                text = value.decode() if isinstance(value, bytes) else value
                scheme, _, given = text.partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token.encode()):
                    return Verdict(True)
                return Verdict(False, "bad bearer token", unauthenticated=True)
        return Verdict(False, "a bearer token is needed (authorization: Bearer ...)", unauthenticated=True)
