"""The index's predicted hit against the hit the replica reports in its response body.

vLLM reports a request's cached prompt tokens as ``usage.prompt_tokens_details.cached_tokens``
(with ``--enable-prompt-tokens-details``): at the end of a JSON body, and in the last chunk of a
stream whose client asked ``stream_options.include_usage``. Both sit in the last bytes of the body,
so only a bounded tail is kept while the body passes through unchanged (a stream is never held).

A prediction agrees when it is within one block of the report: vLLM recomputes a prompt's last
token, so a fully cached, block-aligned prompt reports one block fewer than it holds.
"""

from __future__ import annotations

import re

TAIL_BYTES = 4096
"""The usage object is a few hundred bytes: the last 4 KB of a body hold it whatever the chunking."""

_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


class UsageTail:
    """The last :data:`TAIL_BYTES` of a response body, and the cached tokens they report."""

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        """One more piece of the body."""
        self._tail = (self._tail + chunk[-TAIL_BYTES:])[-TAIL_BYTES:]

    def cached_tokens(self) -> int | None:
        """The last ``cached_tokens`` the body reported; None if it reported none."""
        found = _CACHED.findall(self._tail)
        return int(found[-1]) if found else None


def outcome(predicted: int, reported: int, block_size: int) -> str:
    """``agree`` within one block, else ``over`` (the index promised more than was cached: stale
    or lost removals) or ``under`` (the replica had more than the index knew)."""
    if abs(predicted - reported) <= block_size:
        return "agree"
    return "over" if predicted > reported else "under"
