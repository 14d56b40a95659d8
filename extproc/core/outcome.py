"""What comes back from the replica, learnt from: a request's response headers, its first token,
its last, its end.

Each request's life after its decision is kept on its :class:`~extproc.core.bookkeeping.Routed`:
answered (its headers seen), its first token (a timed stream's first event with a token, or a
non-streamed answer's placed from the engine's decode), its tokens over, ended (once, whatever
ended it). The bookkeeping hooks hear of each step here.
"""

from __future__ import annotations

from collections.abc import Callable

from extproc.config import Config
from extproc.core.bookkeeping import Hook, Routed, answered, ended
from extproc.fleet.health.output_lengths import OutputLengths
from extproc.fleet.health.rates import RateBook
from extproc.fleet.health.replicas import ReplicaBook
from extproc.fleet.queueing import FairQueue
from extproc.observe.metrics import RouterMetrics


class Outcomes:
    """Learns from each routed request's response, and frees what it held when it ends."""

    def __init__(
        self,
        config: Config,
        clock: Callable[[], float],
        metrics: RouterMetrics,
        replicas: ReplicaBook,
        rates: RateBook,
        hooks: tuple[Hook, ...],
        queue: FairQueue | None = None,
        outputs: OutputLengths | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.metrics = metrics
        self.replicas = replicas
        self.rates = rates
        self.hooks = hooks
        self.queue = queue
        self.outputs = outputs

    def observe_response(
        self, routed: Routed, status: int, attempts: int = 1, answered_by: str | None = None, timed: bool = False
    ) -> None:
        """Learn from the response headers Envoy saw: status (and, the body not ``timed``, time to
        first byte).

        With ``attempts`` > 1 Envoy tried elsewhere too. A stream's try is reset at its first-byte
        timeout, so the answer is another replica's; a non-streaming try's budget only hedges
        (the first try keeps running), so the answer may still be the chosen replica's, which
        ``answered_by`` (the answering address, when Envoy's config adds it) tells. An answer from
        another replica after the first-byte timeout means the chosen replica's try met it: a
        failure of that replica (three in a row eject it). A quick retry (connection refused or
        reset) is not counted: the scraper sees a replica that refuses connections for itself,
        and a burst that overflows a listen backlog for a moment must not eject a healthy replica.

        ``timed``: its body will be read for when its tokens came (:meth:`first_token`,
        :meth:`tokens_over`): the hooks hear of its first token then, not now. A stream's headers
        say nothing of it: vLLM sends them before the engine has even queued the request.
        """
        replica = routed.decision.replica
        self.metrics.responses_observed.inc()
        ok = 0 < status < 400
        if routed.arm is not None:
            labels = (routed.arm.rule, routed.arm.label)
            if not (timed and ok and routed.features.stream):  # else at its first token
                self.metrics.split_ttft_seconds.labels(*labels).observe(self.clock() - routed.decided_at)
            if status == 0 or status >= 500:
                self.metrics.split_errors.labels(*labels).inc()
        if replica is None:
            return
        now = self.clock()
        routed.headers_at, routed.status, routed.tries = now, status, attempts
        waited = now - routed.decided_at
        stream_timed = timed and routed.features.stream
        if attempts <= 1 or answered_by == replica.address:
            # A timed stream's first token is what its replica is judged on (first_token).
            self.replicas.observe(replica.name, status, None if stream_timed else waited, now)
        else:
            routed.load_point = None  # its first byte was another replica's: nothing to learn
            if waited >= self.config.upstream.first_byte_s:
                self.replicas.observe(replica.name, 0, None, now)
        if status >= 400 or status == 0:
            routed.load_point = None  # an error's latency is not the replica's serving time
            timed = False
        routed.timed = timed
        if not timed:
            routed.answered_at = now
            answered(self.hooks, routed)

    def first_token(self, routed: Routed, now: float) -> None:
        """A timed stream's first token passed at ``now``: its prefill is over."""
        replica = routed.decision.replica
        if replica is None or not routed.timed or routed.first_token_seen:
            return
        routed.answered_at, routed.first_token_seen = now, True
        if routed.arm is not None:
            self.metrics.split_ttft_seconds.labels(routed.arm.rule, routed.arm.label).observe(now - routed.decided_at)
        if routed.load_point is not None:  # its own answer, not a retry's or an error's
            self.replicas.observe_first_token(replica.name, now - routed.decided_at, now)
            self.metrics.first_token(replica.name, now - routed.decided_at, "stream")
        answered(self.hooks, routed)

    def first_token_deadline(self, routed: Routed) -> float | None:
        """When a timed stream still waiting for its first token is given up (its decision plus
        ``upstream.first_byte_s``); None when nothing is waited for."""
        if not routed.timed or routed.first_token_seen or not routed.features.stream or routed.released:
            return None
        if routed.tries > 1 and routed.headers_at is not None:
            # Another try answered, sent at most first_byte_s x tries after the decision: its
            # budget runs from its headers.
            return routed.headers_at + self.config.upstream.first_byte_s
        return routed.decided_at + self.config.upstream.first_byte_s

    def first_token_overdue(self, routed: Routed) -> None:
        """A timed stream's replica sent no token by its deadline: a failure of that replica, as a
        first-byte timeout is (three in a row eject it), whatever its headers said."""
        replica = routed.decision.replica
        if replica is None or not routed.timed or routed.first_token_seen:
            return
        routed.timed = False  # given up: never timed again
        routed.load_point = None  # nothing to learn from it
        self.metrics.first_token_timeouts.labels(replica.name).inc()
        if routed.tries <= 1:  # else another replica's try stalled, which one is not known here
            self.replicas.observe(replica.name, 0, None, self.clock())

    def tokens_over(self, routed: Routed, first_at: float | None, last_at: float | None, output_tokens: int) -> None:
        """A timed body is over, with ``output_tokens`` generated (the engine's report, else the
        events counted). A stream: its time per output token from its first and last tokens'
        times. A non-streamed answer, whose headers came with its last token: its first token
        is that time less its decode, ``output_tokens - 1`` gaps at the replica's mean
        inter-token gap as its engine reports it (exact for one token); before the engine has
        reported a gap, the replica's decode step places it for its objectives, and nothing is
        learnt from it. Its prefill is over now, if not before."""
        replica = routed.decision.replica
        if replica is None or not routed.timed:
            return
        if output_tokens > 0:
            self.metrics.observed_output_tokens.labels(replica.name).observe(output_tokens)
        if self.outputs is not None:
            features = routed.features
            self.outputs.observe(features.model, output_tokens, features.max_output_tokens)
        if routed.first_token_seen:  # a stream
            if first_at is not None and last_at is not None and output_tokens > 1:
                routed.tpot_s = (last_at - first_at) / (output_tokens - 1)
                self.metrics.observed_tpot_seconds.labels(replica.name).observe(routed.tpot_s)
            return
        if routed.features.stream or routed.answered_at is not None or routed.headers_at is None:
            return  # a stream without a token: nothing learnt
        gap = self.replicas.inter_token_s(replica.name) if output_tokens > 1 else 0.0
        reported = gap is not None
        if gap is None:  # no gap reported yet: the replica's decode step (learnt, else its prior)
            gap = self.rates.rates(replica.name, replica.labels).decode_step_s
        if output_tokens > 0:
            routed.answered_at = max(routed.decided_at, routed.headers_at - (output_tokens - 1) * gap)
            # Learnt from only when the engine reported the gap; judged against objectives either way.
            routed.first_token_seen, routed.first_token_estimated = reported, not reported
            if output_tokens > 1:
                routed.tpot_s = gap
            if reported and routed.load_point is not None:
                ttft_s = routed.answered_at - routed.decided_at
                self.metrics.first_token(replica.name, ttft_s, "unary")
        else:
            routed.answered_at = routed.headers_at
        answered(self.hooks, routed)

    def release(self, routed: Routed) -> None:
        """The request is over (or abandoned): its in-flight slot is freed, once."""
        if routed.trace is not None:
            trace, routed.trace = routed.trace, None
            trace.end(routed.status)
        if not ended(self.hooks, routed):
            return
        replica = routed.decision.replica
        if replica is not None and routed.headers_at is not None:  # answered: its end-to-end time
            self.metrics.request_completed(replica.name, self.clock() - routed.decided_at)
        if self.queue is not None:
            self.queue.wake()  # a slot freed: the head of the queue may go
