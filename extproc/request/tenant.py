"""Which tenant a request belongs to: from an API key (the ``Authorization`` bearer token, mapped
by its SHA-256 digest, so the config never holds a key and nothing logs one) or from a header the
gateway itself sets (``tenants.trust_header``; otherwise the header is a client's claim and is
never read: the caller passes no header name).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

TENANT_HEADER = "x-tenant-id"
"""The header naming the tenant when no API key maps the request (config ``tenants.header``)."""


def api_key_digest(token: str) -> str:
    """The hex SHA-256 of an API key: what tenant mappings are keyed by."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def bearer_token(authorization: str) -> str | None:
    """The token of an ``Authorization: Bearer ...`` header."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def resolve_tenant(headers: Mapping[str, str], header: str, api_keys: Mapping[str, str]) -> str:
    """A mapped API key wins over the header; ``header`` is empty unless the gateway sets it (a
    client's own is no identity)."""
    if api_keys:
        auth = headers.get("authorization")
        token = bearer_token(auth) if auth else None
        if token:
            tenant = api_keys.get(api_key_digest(token))
            if tenant:
                return tenant
    return headers.get(header, "")[:128] if header else ""
