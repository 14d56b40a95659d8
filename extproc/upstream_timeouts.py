"""How long Envoy waits for a replica: the first byte of each try, and the gaps in a stream.

A hung replica (a stuck collective, a wedged engine) accepts connections and never answers. Only
Envoy's route timeout (minutes, since a generation may legitimately run that long) would end such
a request, so each try also gets a **first-byte timeout**: a try that has not seen response
headers by then is abandoned and, as nothing has reached the client yet, retried on another
replica. A stream that stalls after its headers cannot be retried (the client has bytes); its
**idle timeout** ends it with a reset, which the client sees as an error in seconds instead of
minutes. That timer (Envoy's route ``idle_timeout``) also runs while the first-byte tries wait, so
it must be longer than all of them together (``envoy_config`` checks it).

The first byte of a non-streaming response comes only after its last token, so its budget grows
with ``max_tokens``: the processor sends it per request in Envoy's
``x-envoy-upstream-rq-per-try-timeout-ms`` header. A streaming request is marked with
``stream_header``, which routes it where the idle timeout applies. Defaults come from a
10,000-token prefill on a slow replica (``benchmarks/first_byte_budget.py``, README).
"""

from __future__ import annotations

from dataclasses import dataclass

PER_TRY_TIMEOUT_HEADER = "x-envoy-upstream-rq-per-try-timeout-ms"
ATTEMPT_COUNT_HEADER = "x-envoy-attempt-count"


@dataclass(frozen=True, slots=True)
class UpstreamTimeouts:
    """Config ``upstream:``: per-try timeouts the processor and the rendered Envoy config share."""

    # 10,000 tokens behind four prompts like it on a replica decoding 512 sequences of 8k tokens
    # prefill in 5.7 s in the llama-8b-h100 timing model; 8 s leaves room for a slower engine.
    first_byte_s: float = 8.0
    # Envoy's idle timer of a streaming request (a route idle_timeout) runs from the end of the
    # request, so it must outlast the first-byte tries before the headers: 3 tries x 8 s < 25 s.
    # After the headers a stream's gaps are one engine step (0.28 s in that case).
    stream_idle_s: float = 25.0
    # A non-streaming try waits its whole generation: one decode step per output token there.
    unary_s_per_output_token: float = 0.3
    stream_header: str = "x-extproc-stream"

    def request_headers(self, stream: bool, max_output_tokens: int | None) -> list[tuple[str, str]]:
        """Headers that give one routed request its per-try bounds.

        A non-streaming request without ``max_tokens`` may generate up to the model's context, so
        its try is bounded only by the route timeout (``0`` lifts the route's per-try timeout).
        """
        if stream:
            return [(self.stream_header, "1")]
        if max_output_tokens is None:
            return [(PER_TRY_TIMEOUT_HEADER, "0")]
        budget_s = self.first_byte_s + max(0, max_output_tokens) * self.unary_s_per_output_token
        return [(PER_TRY_TIMEOUT_HEADER, str(round(budget_s * 1000)))]


def attempts(value: str | None) -> int:
    """Envoy's ``x-envoy-attempt-count`` response header: tries made (1 when absent or garbled)."""
    if value is None or not value.isdigit():
        return 1
    return max(1, int(value))
