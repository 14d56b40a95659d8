"""The invalid-configuration error: its message names the field."""

from __future__ import annotations


class ConfigError(ValueError):
    """The configuration is invalid; the message names the field."""
