"""Outages of a remote store: one log line when one starts, one when it ends, backoff between probes.

A store that failed stays *down* until a probe succeeds: requests in the meantime do not try it
(no per-request timeout while Redis is away), and errors are logged once per episode, not once
per request, so an outage does not flood the log. A Redis that is slow rather than gone answers
probes and then times out again: such flapping episodes within ``quiet_s`` of a logged one are
counted and logged at debug level only, and the next logged line says how many there were.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("extproc.state")


class Outage:
    """Whether a remote store is usable, and the episode it is in when it is not."""

    def __init__(
        self,
        name: str,
        base_delay_s: float = 0.05,
        max_delay_s: float = 1.0,
        quiet_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.base_delay_s = base_delay_s
        self.max_delay_s = max_delay_s
        self.quiet_s = quiet_s
        self.clock = clock
        self.down = False
        self.episodes = 0
        self.errors_in_episode = 0
        self._since = 0.0
        self._delay = base_delay_s
        self._logged_at: float | None = None
        self._logging_episode = False
        self._unlogged = 0

    def failed(self, operation: str, exc: BaseException) -> bool:
        """Note a failure; True when it starts a new episode."""
        self.errors_in_episode += 1
        if self.down:
            return False
        self.down = True
        self.episodes += 1
        now = self._since = self.clock()
        self._delay = self.base_delay_s
        self._logging_episode = self._logged_at is None or now - self._logged_at >= self.quiet_s
        # The exception's text, never the URL: the URL may carry a password.
        if self._logging_episode:
            self._logged_at = now
            earlier = f"; {self._unlogged} brief outages since the last report" if self._unlogged else ""
            self._unlogged = 0
            log.warning(
                "affinity store %s unavailable (%s failed: %s: %s)%s; routing on local state until it returns",
                self.name,
                operation,
                type(exc).__name__,
                exc,
                earlier,
            )
        else:
            self._unlogged += 1
            log.debug("affinity store %s unavailable again (%s: %s)", self.name, type(exc).__name__, exc)
        return True

    def recovered(self) -> bool:
        """Note a success; True when it ends an episode."""
        if not self.down:
            return False
        self.down = False
        if self._logging_episode:
            log.warning(
                "affinity store %s is back after %.1fs (%d failed operations); writes resume",
                self.name,
                self.clock() - self._since,
                self.errors_in_episode,
            )
        self.errors_in_episode = 0
        self._delay = self.base_delay_s
        return True

    def next_delay(self) -> float:
        """How long to wait before the next probe: doubling from ``base_delay_s`` to ``max_delay_s``."""
        delay = self._delay
        self._delay = min(self._delay * 2, self.max_delay_s)
        return delay
