"""What the router wants done with one request, in plain values: the plan an adapter carries out.

The ext_proc stream (:mod:`extproc.adapters.server.stream`) only translates these into Envoy's messages;
every choice is made here, through the :class:`~extproc.app.router.Router`:

- when the request's headers arrive, a :class:`Watch`: what to see of its response (sampled by
  ``health.response_sample_rate`` and ``kv_events.check_sample_rate``), decided then because
  only the request-headers answer can change what Envoy sends next;
- once it is routed, a :class:`Plan`: :class:`Forward` it (to a replica, with these headers set
  and these removed, its body replaced or not; or unrouted, down Envoy's default route), or
  :class:`Refuse` it with a status and a message;
- when its response headers arrive, whether to read its response body (a usage check), and
  what that body reports once it is over.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from extproc.app.router import Router
from extproc.base.upstream_timeouts import ANSWERED_BY_HEADER, ATTEMPT_COUNT_HEADER, attempts
from extproc.core.bookkeeping import Routed
from extproc.observe.tracing import TRACEPARENT
from extproc.request.agent_apis import TRANSCRIPT_BYTES
from extproc.request.kv_transfer import prefiller_header
from extproc.request.token_clock import TokenClock
from extproc.request.usage import Usage, UsageStripper, UsageTail
from extproc.routing.model import Reason

QUOTA_MESSAGE = "this tenant is over its quota of concurrent requests; retry later"
FIRST_TOKEN_MESSAGE = "the replica sent no token within upstream.first_byte_s; retry"
NO_ENDPOINT_MESSAGE = "the inference pool has no ready endpoint"
SUBSET_MESSAGE = "none of the endpoints the gateway offered for this request (its subset hint) is a ready replica"


class ResponseHeaders(enum.Enum):
    """What a request's headers answer asks of Envoy for its response headers."""

    AS_CONFIGURED = "as_configured"
    """No change: the filter's own processing mode."""
    SEND = "send"
    """Send them even so: asked for only to read the body (a usage check, not a health sample)."""
    SKIP = "skip"
    """Skip them: the request is not a health sample."""


@dataclass(frozen=True, slots=True)
class Watch:
    """What the processor wants to see of one request's response."""

    sampled: bool = True
    """A health sample: its response headers are wanted for the replicas' health (status, time
    to first byte)."""
    check_usage: bool = False
    """Its response body is read for the cached tokens it reports, against the KV-event index's
    prediction (when one is made)."""
    meter: bool = False
    """Its response body is read for the tokens it used (``budgets:``)."""
    timed: bool = False
    """Its response body is read for when its tokens came (:mod:`extproc.request.token_clock`): its time to
    first token and per output token, which its headers do not tell (``health.latency_models``)."""
    transcript: bool = False
    """Its response body is read for the answer the engine stores (a Responses API request, with
    KV events): its next turn is then hashed as the engine renders it."""

    @property
    def reads_body(self) -> bool:
        """Whether its response body may be read."""
        return self.check_usage or self.meter or self.timed or self.transcript

    @property
    def response_headers(self) -> ResponseHeaders:
        """How the headers answer has Envoy treat the response headers."""
        if self.sampled:
            return ResponseHeaders.AS_CONFIGURED
        return ResponseHeaders.SEND if self.reads_body else ResponseHeaders.SKIP

    @property
    def observe(self) -> bool:
        """Whether response headers that arrive feed health: all but those asked for only to read
        the body (an Envoy without ``allow_mode_override`` sends every request's)."""
        return self.sampled or not self.reads_body


EVERYTHING = Watch()
"""A request whose watch is not sampled: its response headers observed, its body not read."""


@dataclass(frozen=True, slots=True)
class Forward:
    """Send the request upstream: to a chosen replica (``to_replica``: headers set, Envoy's route
    chosen again) or, without one, down Envoy's default route."""

    set_headers: tuple[tuple[str, str], ...] = ()
    """Headers to set (overwriting), in order; ``content-length`` last when the body is replaced."""
    remove_headers: tuple[str, ...] = ()
    """Headers to remove: the routing headers a client may have set."""
    to_replica: bool = False
    lb_metadata: tuple[tuple[str, str], ...] = ()
    """``envoy.lb`` dynamic metadata (endpoint mode: the replica and its fallbacks, in order)."""
    body: bytes | None = None
    """The body to send instead of the client's (rewritten for its split arm)."""

    @property
    def only_strips(self) -> bool:
        """Unrouted, body unchanged: nothing to do but the removals (a request-headers answer makes them)."""
        return not self.to_replica and not self.set_headers and self.body is None


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer the client at once with an error (OpenAI's JSON shape), never sending it upstream."""

    status: int
    message: str
    kind: str
    retry_after_s: int | None = None
    headers: tuple[tuple[str, str], ...] = ()
    """More response headers (a token budget's ``x-ratelimit-*-tokens``)."""


@dataclass(slots=True)
class Plan:
    """One routed request: what to do with it, and what is still to be learnt from its response."""

    action: Forward | Refuse
    routed: Routed
    watch: Watch
    predicted: int | None = None
    """Cached tokens the KV-event index predicted (a usage check was sampled and can be made)."""
    usage: UsageTail | None = None
    """The response body's tail, while it is read."""
    stripper: UsageStripper | None = None
    """While a stream is read whose client did not ask for its usage chunk: takes it out."""
    clock: TokenClock | None = None
    """While a timed body is read: when its tokens passed."""
    response_set_headers: tuple[tuple[str, str], ...] = ()
    """Headers added to the response (a budgeted request's ``x-ratelimit-*``), set with its headers."""
    transcript: bytearray | None = None
    """While a Responses answer is read for what the engine stores of it: its bytes so far."""


class Planner:
    """Makes a request's plan through the router, and learns from its response."""

    def __init__(self, router: Router) -> None:
        self.router = router
        cfg = self.config = router.config
        # The router's parts the rest of a request's life goes through, named once here.
        self.clock = router.clock
        self.outcomes, self.charges, self.watching = router.outcomes, router.charges, router.watching
        self.kv_events = router.kv_events
        self.metered = router.budgets is not None
        self.stream_errors = router.metrics.stream_errors
        self.strip: tuple[str, ...] = cfg.routing_headers
        """The routing headers a client must not set: removed from every request."""
        self.max_body_bytes = cfg.features.max_body_bytes
        """Past this much body the request is routed on what has come (the rest let through)."""
        self.picks_or_refuses = cfg.mode == "endpoint" and cfg.discovery.type == "inference_pool"
        """An InferencePool's picker: no replica to pick is a 503 (GIE's protocol), never Envoy's own choice."""

    def watch(self, *, can_override: bool, whole_body: bool, headers: Mapping[str, str] | None = None) -> Watch:
        """The watch of a request with a body, decided with its ``headers``. ``can_override``: its
        headers answer can change Envoy's processing mode (not with FULL_DUPLEX_STREAMED);
        ``whole_body``: its body comes in one buffered piece (a usage check needs all of it)."""
        if not can_override:
            return EVERYTHING
        watching = self.watching
        sampled = watching.sample_response()
        kv = self.kv_events
        check = kv is not None and whole_body and kv.sample_check()
        timed = sampled and watching.times_tokens(headers or {}) and watching.sample_timing()
        return Watch(sampled, check, self.metered, timed, watching.keeps_answers(headers or {}))

    async def plan(self, headers: Mapping[str, str], body: bytes | None, watch: Watch = EVERYTHING) -> Plan:
        """Route the request and say what to do with it."""
        routed = await self.router.route(headers, body, timed=watch.timed)
        decision = routed.decision
        replica = decision.replica
        kv = self.kv_events
        predicted = None
        if watch.check_usage and kv is not None and replica is not None:
            predicted = kv.predicted_tokens(routed.features, replica.name, decision.matched_blocks, routed.decided_at)
        return Plan(self._action(routed), routed, watch, predicted)

    def _action(self, routed: Routed) -> Forward | Refuse:
        decision = routed.decision
        if routed.refusal is not None:
            refusal = routed.refusal
            extra = tuple(routed.budget.headers().items()) if routed.budget is not None else ()
            return Refuse(refusal.status, refusal.message, refusal.kind, refusal.retry_after_s or None, extra)
        if decision.reason is Reason.QUOTA:
            return Refuse(429, QUOTA_MESSAGE, "quota_exceeded", decision.retry_after_s)
        length = () if routed.answer.body is None else (("content-length", str(len(routed.answer.body))),)
        replica = decision.replica
        if replica is None and routed.features.subset is not None:
            # The gateway named where it may go and none of it will do: 503, as GIE's protocol says.
            return Refuse(503, SUBSET_MESSAGE, "no_endpoint_in_subset")
        if replica is None and self.picks_or_refuses:
            return Refuse(503, NO_ENDPOINT_MESSAGE, "no_ready_endpoint")
        if replica is None:
            # No replica known (discovery has not answered yet, or the fleet is empty): Envoy
            # routes it on its own (the default route), and answers 503 itself if it has none.
            return Forward(length, self.strip, body=routed.answer.body)
        cfg = self.config
        lb: tuple[tuple[str, str], ...] = ()
        if cfg.mode == "endpoint":
            target = [(cfg.headers.destination_endpoint, replica.address)]
            chain = ",".join([replica.address, *(f.address for f in decision.fallbacks)])
            lb = ((cfg.headers.destination_endpoint, chain),)
        else:
            target = [(cfg.headers.target_cluster, replica.name)]
        features = routed.features
        headers = [*target, *cfg.upstream.request_headers(features.stream, features.max_output_tokens)]
        if routed.trace is not None and routed.trace.traceparent is not None:
            # The replica continues the trace under its call's span.
            headers.append((TRACEPARENT, routed.trace.traceparent))
        if decision.prefill is not None:  # the decode replica's sidecar makes the prefill hop
            headers.append(prefiller_header(decision.prefill.address))
        names = {name for name, _ in headers}
        removals = tuple(h for h in self.strip if h not in names)
        return Forward((*headers, *length), removals, to_replica=True, lb_metadata=lb, body=routed.answer.body)

    def response_headers(self, plan: Plan, headers: Mapping[str, str]) -> bool:
        """Learn from the response headers (a health sample); True to read the response body."""
        routed = plan.routed
        status = headers.get(":status", "0")
        routed.status = int(status) if status.isdigit() else 0  # seen, sampled for health or not
        tries = attempts(headers.get(ATTEMPT_COUNT_HEADER))
        answered_by = headers.get(ANSWERED_BY_HEADER)
        timed = plan.watch.timed and status == "200"
        if plan.watch.observe:
            self.outcomes.observe_response(routed, int(status) if status.isdigit() else 0, tries, answered_by, timed)
        chosen = routed.decision.replica
        own = tries == 1 or (chosen is not None and answered_by == chosen.address)
        metered = routed.budget is not None and status == "200"
        if routed.budget is not None and routed.budget.admitted:
            # OpenAI's clients read these on every answer, not only on a 429.
            plan.response_set_headers = tuple(routed.budget.headers().items())
        if routed.answer.strip_usage and status == "200" and (metered or timed):
            plan.stripper = UsageStripper()  # every such stream is read, to take the chunk out
        # A body another replica answered (after a retry or a hedge): nothing to check.
        check = plan.predicted is not None and status == "200" and own
        if timed and routed.timed:
            plan.clock = TokenClock()
        if plan.watch.transcript and status == "200" and own and routed.features.response_id is not None:
            plan.transcript = bytearray()
        if plan.transcript is not None and not (check or metered or plan.clock is not None):
            return True
        if check or metered or plan.clock is not None:
            plan.usage = UsageTail()
            return True
        return False

    async def response_body(self, plan: Plan, chunk: bytes, end_of_stream: bool) -> bytes | None:
        """One piece of a response body being read: the bytes to pass on instead (None: the
        piece unchanged). At its end, the usage check is made and the usage charged."""
        out = None
        clock = plan.clock
        if clock is not None and clock.feed(chunk, now := self.clock()) and plan.routed.features.stream:
            self.outcomes.first_token(plan.routed, now)
        if plan.stripper is not None:
            out = plan.stripper.feed(chunk, end_of_stream)
            out = None if out == chunk else out
        if plan.usage is not None:
            plan.usage.feed(chunk)
        if plan.transcript is not None:
            if len(plan.transcript) + len(chunk) > TRANSCRIPT_BYTES:
                plan.transcript = None  # too long to keep: its next turn goes by its pin alone
            else:
                plan.transcript += chunk
        if end_of_stream:
            if plan.transcript is not None:
                self.watching.answered(plan.routed.features, bytes(plan.transcript))
                plan.transcript = None
            await self._body_over(plan)
        return out

    def first_token_deadline(self, plan: Plan) -> float | None:
        """When to give up on a timed stream whose first token has not come (the router's clock);
        None when nothing is waited for."""
        return self.outcomes.first_token_deadline(plan.routed)

    def first_token_overdue(self, plan: Plan) -> Refuse:
        """Its deadline passed without a token: counted against its replica, and the answer that
        ends it (the client may have its headers, never a token: it retries)."""
        self.outcomes.first_token_overdue(plan.routed)
        plan.clock = None
        return Refuse(504, FIRST_TOKEN_MESSAGE, "first_token_timeout")

    def end(self, plan: Plan) -> None:
        """The stream is over: a body cut short (trailers, a reset) is checked on what came, a
        request sent upstream and not charged is charged an estimate (an abandoned
        stream's prompt and the output seen), and the in-flight slot released."""
        if plan.usage is not None:
            self._check_usage(plan, plan.usage)
            self._tokens_over(plan, plan.usage.usage())
        if isinstance(plan.action, Forward):
            self.charges.charge_unreported(plan.routed, plan.usage.output_seen if plan.usage is not None else None)
        plan.usage = None
        self.charges.release_budget(plan.routed)
        self.router.release(plan.routed)

    async def _body_over(self, plan: Plan) -> None:
        tail, plan.usage = plan.usage, None
        if tail is None:
            return
        self._check_usage(plan, tail)
        usage = plan.stripper.usage if plan.stripper is not None and plan.stripper.usage else tail.usage()
        self._tokens_over(plan, usage)
        if usage is None and plan.routed.budget is not None:
            # Metered, no report (a stream not asked for it, an API that reports none): what it was seen to use.
            usage = self.charges.estimated_usage(plan.routed, tail.output_seen)
        if usage is not None:
            await self.charges.charge_usage(plan.routed, usage)

    def _tokens_over(self, plan: Plan, usage: Usage | None) -> None:
        """A timed body is over (or cut short): when its tokens came, and how many."""
        clock, plan.clock = plan.clock, None
        if clock is None:
            return
        reported = usage.output if usage is not None else None
        self.outcomes.tokens_over(plan.routed, clock.first_at, clock.last_at, clock.output_tokens(reported))

    def _check_usage(self, plan: Plan, tail: UsageTail) -> None:
        kv, routed = self.kv_events, plan.routed
        replica = routed.decision.replica
        if kv is None or plan.predicted is None or replica is None:
            return
        kv.check(replica.name, plan.predicted, tail.cached_tokens(), routed.features.tokens_per_block)
