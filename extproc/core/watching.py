"""What the processor watches of a request's response: which headers are sampled for health,
which bodies are timed for their tokens, which answers are read for what their engine keeps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from extproc.base.sampling import RateSampler
from extproc.config import Config
from extproc.fleet.health.latency import LatencyBook
from extproc.request.agent_apis import RESPONSES_PATH, answer_messages
from extproc.request.features import SLO_TPOT_HEADERS, SLO_TTFT_HEADERS, RequestFeatures, request_path

if TYPE_CHECKING:  # its module loads the tokenizers: only servers with KV events pay for that
    from extproc.fleet.kvevents.cache_state import EventCacheState

OBJECTIVE_HEADERS = (*SLO_TTFT_HEADERS, *SLO_TPOT_HEADERS)


class Watching:
    """Decides, per request, what of its response is read (deterministic sampling at the config's rates)."""

    def __init__(self, config: Config, latency: LatencyBook, kv_events: EventCacheState | None = None) -> None:
        self.config = config
        self.latency = latency
        self.kv_events = kv_events
        self.learn_on_objective = config.health.latency_models == "auto"
        self._responses = RateSampler()  # health.response_sample_rate
        self._timings = RateSampler()  # health.token_timing_rate

    def keeps_answers(self, headers: Mapping[str, str]) -> bool:
        """Whether a request's answer is read for what its engine stores of it: a Responses API
        request where KV events are read (its next turn is hashed in the engine's key space)."""
        return self.kv_events is not None and request_path(headers) == RESPONSES_PATH

    def answered(self, features: RequestFeatures, body: bytes) -> None:
        """A Responses answer read whole: the conversation its engine stores under its id."""
        response_id = features.response_id
        if self.kv_events is None or response_id is None:
            return
        answer = answer_messages(body)
        if answer is not None:
            self.kv_events.responses.answered(response_id, answer)

    def times_tokens(self, headers: Mapping[str, str]) -> bool:
        """Whether a sampled response's body is read for when its tokens came (its time to first
        token and per output token): wherever the latency models learn (``health.latency_models``),
        or would from this request on (it may carry an objective), and where split arms are
        compared (their TTFT); or always, or never (``health.token_timing``)."""
        timing = self.config.health.token_timing
        if timing != "auto":
            return timing == "always"
        if self.latency.learning or self.config.splits:
            return True
        if not self.learn_on_objective:
            return False
        features = self.config.features
        if features.tenant_objectives or any(rule.objectives is not None for rule in features.classes):
            return True
        return any(name in headers for name in OBJECTIVE_HEADERS)

    def sample_timing(self) -> bool:
        """Whether this answer, one :meth:`times_tokens` would time, is (``health.token_timing_rate``)."""
        return self._timings.take(self.config.health.token_timing_rate)

    def sample_response(self) -> bool:
        """Whether to observe the next request's response headers (``health.response_sample_rate``).

        Deterministic: with a rate of 0.25 exactly every fourth request is observed. A request that
        is not observed keeps its in-flight slot until its stream ends (Envoy holds the ext_proc
        stream open until the HTTP request is over) and its prefill counts as pending until then.
        """
        if self.config.splits:  # a canary is judged on every response of its arms
            return True
        return self._responses.take(self.config.health.response_sample_rate)
