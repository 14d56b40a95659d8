"""Warming replicas with hot prefixes: a joining replica gets the top hot prompts, and a member new
to a hot prefix's replica set gets that prefix's kept request, prefill only, before its traffic
reaches it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from extproc.observe.hotkeys.detector import HotKeyDetector, label

log = logging.getLogger("extproc.observe.hotkeys")

Warm = Callable[[str, str, bytes], bool]
"""Send replica ``name`` one request (``path``, ``body``) to prefill: the pre-warmer's rate limit
and queue; False when it was not queued."""


class HotKeyWarmer:
    """What the router does with the detector's findings besides deciding with its table."""

    def __init__(self, detector: HotKeyDetector, warm: Warm) -> None:
        self.detector = detector
        self.warm = warm

    def offer(self, fp: int | None, path: str, body: bytes | Callable[[], bytes]) -> None:
        """Keep a request of a hot prefix (one per hot key, ``fp`` its prefix key's fingerprint) to
        warm replicas with; ``body`` may be a function that builds it, called only when one is wanted."""
        if fp is None:
            return
        if self.detector.wants_exemplar(fp):
            self.detector.keep_exemplar(fp, path, body() if callable(body) else body)

    def joined(self, name: str) -> int:
        """Send joining replica ``name`` the top hot prefixes (queued now, so they reach it before
        most of the traffic it is about to take); how many were queued."""
        if not self.detector.settings.warm_on_join:
            return 0
        sent = sum(self.warm(name, path, body) for path, body in self.detector.warm_set())
        if sent:
            log.info("warming %s with %d hot prefixes", name, sent)
        return sent

    def widened(
        self, fp: int | None, hot_set: tuple[str, ...], chosen: str, matches: Mapping[str, int], total: int
    ) -> int:
        """Warm the members new to a hot prefix's replica set ``hot_set`` (``fp``: the prefix key's
        fingerprint; its k grew, or the load
        bound walked past one) with its kept request; ``chosen`` is warmed by the request itself,
        and a member believed to hold half of the prompt (``matches`` of ``total`` blocks) already
        is left alone. How many were queued."""
        if fp is None or not hot_set:
            return 0
        exemplar = self.detector.exemplar(fp)
        if exemplar is None:
            return 0
        holding = {chosen} | {name for name, n in matches.items() if total and 2 * n >= total}
        sent = sum(self.warm(name, *exemplar) for name in self.detector.newcomers(fp, hot_set, holding))
        if sent:
            log.info("warming %d new replicas of hot prefix %s", sent, label(fp))
        return sent
