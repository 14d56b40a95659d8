"""Whether Envoy's ext_proc filter is configured so that the router can route, judged from the
streams it sends.

A filter that sends no request body (``request_body_mode: NONE``) fails open: the processor never
sees a prompt, every request goes down Envoy's default route, round robin, and nothing errs.
Without this check the only sign is a hit ratio that sinks over the next half hour. (``STREAMED``
is no such problem: Envoy 1.40 holds the request until its last body chunk is answered, and a
session was routed sticky with bodies of 700 bytes and of 360 KB alike.)

Each stream tells the check what it saw: the body mode Envoy announced in its first message's
``protocol_config``, and at its end whether a request whose headers said a body follows (a
``content-length``, a chunked body) ever got one. An Envoy that announces no mode (older ones) is
judged on the second alone: three such streams in a row. A problem holds while streams show it
and for ``hold_s`` after the last one, so one good Envoy among bad ones does not hide it, and a
fixed one clears it a minute later.

While a problem holds, :class:`~extproc.adapters.server.app.ProcessorServer` reports the ext_proc service
NOT_SERVING (the readiness probe fails), the metric ``extproc_config_problem{kind}`` is 1, and
the log says so, once when it appears and every ``repeat_s`` while it lasts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm

log = logging.getLogger("extproc.envoy_check")

NO_REQUEST_BODY = "no_request_body"
FIX = {
    NO_REQUEST_BODY: "Envoy's ext_proc filter sends no request body (processing_mode.request_body_mode NONE, "
    "or bodies never arrive): the router cannot see prompts and routes nothing; every request goes down "
    "Envoy's default route. Set request_body_mode: BUFFERED (extproc envoy-config renders it).",
}
"""What each problem means and how to fix it, as logged (docs/runbooks.md#extprocenvoymisconfigured)."""

BODYLESS_IN_A_ROW = 3
"""Streams in a row whose announced body never came, before an Envoy that announces no mode is
judged to send none (one could be a client that went away mid-request)."""


def body_announced(headers: Mapping[str, str]) -> bool:
    """Whether request headers say a body follows (a length above 0, or a chunked body)."""
    length = headers.get("content-length")
    if length is not None:
        return length.strip() not in ("", "0")
    return "chunked" in headers.get("transfer-encoding", "").lower()


def problem_of_mode(mode: int) -> str | None:
    """The problem a request body mode is, if any (a stream keeps BUFFERED, which is none, when
    Envoy announces no mode in ``protocol_config``)."""
    return NO_REQUEST_BODY if mode == pm.ProcessingMode.NONE else None


class EnvoyConfigCheck:
    """The problems of Envoy's ext_proc configuration seen in recent streams."""

    def __init__(
        self,
        clock: Callable[[], float],
        report: Callable[[str, bool], None] = lambda kind, present: None,
        hold_s: float = 60.0,
        repeat_s: float = 60.0,
    ) -> None:
        self.clock = clock
        self.report = report
        """Told each time a kind of problem appears or clears (the metric)."""
        self.hold_s = hold_s
        self.repeat_s = repeat_s
        self._last_seen: dict[str, float] = {}
        self._bodyless = 0
        self._present: dict[str, float] = {}  # kind -> when it was last logged

    def stream_began(self, body_mode: int) -> None:
        """A stream's first message has been read: the body mode Envoy announced in it."""
        kind = problem_of_mode(body_mode)
        if kind is not None:
            self._last_seen[kind] = self.clock()

    def stream_ended(self, body_announced: bool, body_seen: bool) -> None:
        """A stream's end: whether its request headers said a body follows, and whether any came."""
        if not body_announced:
            return
        if body_seen:
            self._bodyless = 0
            return
        self._bodyless += 1
        if self._bodyless >= BODYLESS_IN_A_ROW:
            self._last_seen[NO_REQUEST_BODY] = self.clock()

    def problems(self) -> list[str]:
        """The kinds of problem that hold now."""
        now = self.clock()
        return sorted(kind for kind, seen in self._last_seen.items() if now - seen <= self.hold_s)

    def evaluate(self) -> bool:
        """Update the report and the log from the problems that hold now; True when none does."""
        now = self.clock()
        holding = set(self.problems())
        for kind in holding:
            logged = self._present.get(kind)
            if logged is None:
                self.report(kind, True)
            if logged is None or now - logged >= self.repeat_s:
                self._present[kind] = now
                log.error("ext_proc configuration problem %s: %s", kind, FIX[kind], extra={"event": "config_problem"})
        for kind in set(self._present) - holding:
            del self._present[kind]
            self.report(kind, False)
            log.warning("ext_proc configuration problem %s no longer seen", kind)
        return not holding
