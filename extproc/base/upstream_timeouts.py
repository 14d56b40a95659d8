"""How long Envoy waits for a replica: the first byte of each try, and the gaps in a stream.

A hung replica (a stuck collective, a wedged engine, a process stopped) accepts connections and
never answers. Only Envoy's route timeout (minutes, since a generation may legitimately run that
long) would end such a request, so each try also gets a **per-try budget**: a try that has not
seen response headers by then is given up on, and, as nothing has reached the client yet, the
request goes to another replica. What the budget is depends on the request's shape
(``docs/timeouts.md``):

- A **stream**: a try without response headers for ``first_byte_s`` is reset and retried
  elsewhere. vLLM sends a stream's headers at once, before its engine has the request, so that
  bound catches only a replica that does not answer at all; what a real engine shows of being
  stuck is a stream without a token. So the processor also bounds the **first token**: a timed
  stream (``plan.Watch.timed``) without one ``first_byte_s`` after the decision is ended with an
  error and counted as a failure of its replica (it cannot be retried: the client may have its
  headers). After its first token a stream's **idle timeout** ends it with a reset, which the
  client sees as an error in seconds instead of minutes. That timer (Envoy's route
  ``idle_timeout``) also runs while the first-byte tries wait, so it must be longer than all of
  them together (``envoy_config`` checks it).
- A **non-streaming** answer's first byte comes only after its last token, so a replica working
  on a long answer is as silent as a hung one. Its budget is the longest a healthy replica should
  take, ``first_byte_s + unary_s_per_output_token x max_tokens``, never above ``unary_max_s``
  (which is also the budget when ``max_tokens`` is absent: the answer may run to the model's
  context). When it passes, Envoy **hedges**: it sends the request to another replica too and
  keeps the first try running, and the first answer wins. So the budget bounds what a hung
  replica costs and never cuts a healthy answer; its price is duplicate work for the answers that
  outlast it.

The processor sends the budget per request in Envoy's ``x-envoy-upstream-rq-per-try-timeout-ms``
header and marks streams with ``stream_header``, which routes them where the idle timeout applies.
Defaults come from a 10,000-token prefill on a slow replica (``benchmarks/first_byte_budget.py``).
"""

from __future__ import annotations

from pydantic import field_validator, model_validator

from extproc.base.validation import Section, field_error, option

PER_TRY_TIMEOUT_HEADER = "x-envoy-upstream-rq-per-try-timeout-ms"
ATTEMPT_COUNT_HEADER = "x-envoy-attempt-count"
# Envoy adds the address of the replica whose answer it returns (and strips it for the client):
# after a hedge, either try may have won, and only the winner's address tells which.
ANSWERED_BY_HEADER = "x-extproc-answered-by"


class UpstreamTimeouts(Section):
    """``upstream:``: per-try bounds the processor and ``extproc envoy-config`` share (docs/operations.md:
    hung replicas)."""

    # 10,000 tokens behind four prompts like it on a replica decoding 512 sequences of 8k tokens
    # prefill in 5.7 s in the llama-8b-h100 timing model; 8 s leaves room for a slower engine.
    first_byte_s: float = option(
        8.0,
        "a try without response headers by then is retried on another replica; a timed stream without a token, ended",
        ge=0.001,
    )
    # Envoy's idle timer of a streaming request (a route idle_timeout) runs from the end of the
    # request, so it must outlast the first-byte tries before the headers: 3 tries x 8 s < 25 s.
    # After the headers a stream's gaps are one engine step (0.28 s in that case).
    stream_idle_s: float = option(25.0, "a stream silent this long is ended (must exceed 3 x first_byte_s)", ge=0.001)
    # A non-streaming try waits its whole generation: one decode step per output token there.
    unary_s_per_output_token: float = option(0.3, "a non-streaming try waits first_byte_s + this x max_tokens", ge=0)
    # The most a non-streaming try waits before Envoy asks another replica too (also the budget
    # without max_tokens). 60 s: 173 tokens at the slow decode step above, 1,200 at a typical
    # 50 ms; a hung replica costs at most this, a healthy answer longer than it is raced. 0: no
    # cap, for an Envoy whose routes do not hedge (Istio's): without max_tokens only the route
    # timeout bounds the try, as a per-try timeout there would end a healthy answer.
    unary_max_s: float = option(
        60.0,
        "a non-streaming try's budget at most (and without max_tokens); then another replica too. 0: no cap",
        ge=0,
    )
    stream_header: str = option(
        "x-extproc-stream", "marks streaming requests for Envoy's idle-timeout route", min_length=1
    )

    @field_validator("stream_header")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.lower()

    @model_validator(mode="after")
    def _unary_after_first_byte(self) -> UpstreamTimeouts:
        if 0 < self.unary_max_s < self.first_byte_s:
            # Below the first-byte budget every non-streaming request would be sent twice.
            raise field_error(
                UpstreamTimeouts,
                "unary_max_s",
                f"{self.unary_max_s:g} s is below first_byte_s {self.first_byte_s:g} s "
                "(a non-streaming answer comes after its prefill at the earliest)",
                self.unary_max_s,
            )
        return self

    def unary_budget_s(self, max_output_tokens: int | None) -> float | None:
        """A non-streaming try's budget: what its whole generation may take, at most
        ``unary_max_s``; None (no per-try bound) only without max_tokens and without that cap."""
        cap = self.unary_max_s or None
        if max_output_tokens is None:
            return cap
        budget_s = self.first_byte_s + max(0, max_output_tokens) * self.unary_s_per_output_token
        return budget_s if cap is None else min(budget_s, cap)

    def request_headers(self, stream: bool, max_output_tokens: int | None) -> list[tuple[str, str]]:
        """Headers that give one routed request its per-try bounds: a stream's mark (its route
        holds the first-byte and idle timeouts), or a non-streaming try's budget (``0`` lifts
        the route's per-try timeout)."""
        if stream:
            return [(self.stream_header, "1")]
        budget_s = self.unary_budget_s(max_output_tokens)
        return [(PER_TRY_TIMEOUT_HEADER, "0" if budget_s is None else str(max(1, round(budget_s * 1000))))]


def attempts(value: str | None) -> int:
    """Envoy's ``x-envoy-attempt-count`` response header: tries made (1 when absent or garbled)."""
    if value is None or not value.isdigit():
        return 1
    return max(1, int(value))
