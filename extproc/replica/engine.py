"""The fake replica's engine: scheduling, prefix cache, counters and the vLLM /metrics page.

No HTTP here: :meth:`ReplicaEngine.generate` takes a prompt and emits tokens through a callback,
and the clock and the sleep are injected, so tests can drive it in virtual time.

Scheduling follows the shape of a vLLM replica that matters to a router: prefill is serialised
(one prompt at a time), so a replica given more work than the others builds a queue and its
time to first token rises; decode runs concurrently for up to ``max_running`` requests.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from extproc.replica.cache import PrefixCache, count_tokens
from extproc.replica.timing import ReplicaProfile

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]
OnToken = Callable[[int, str], Awaitable[None]]
"""Called with (index, text) for each output token, as soon as it is produced."""

# vLLM's own bucket bounds, so dashboards built for vLLM read these histograms unchanged.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISHED_REASONS = ("stop", "length", "abort")
MAX_OUTPUT_TOKENS = 4096
"""Upper bound on output tokens whatever the request asks."""

_FILLER = (
    "The",
    "replica",
    "answers",
    "with",
    "plain",
    "filler",
    "words",
    "so",
    "that",
    "demos",
    "and",
    "tests",
    "see",
    "steady",
    "token",
    "streams.",
)


def filler_token(index: int) -> str:
    """The text of output token ``index``: deterministic filler words."""
    word = _FILLER[index % len(_FILLER)]
    return word if index == 0 else " " + word


def output_budget(
    default_tokens: int, max_tokens: int | None = None, min_tokens: int = 0, ignore_eos: bool = False
) -> tuple[int, str]:
    """How many tokens a request gets and why it stops: ``(count, "stop" | "length")``.

    The fake model "wants" to answer with ``default_tokens`` (at least ``min_tokens``), or without
    end when ``ignore_eos`` is set, as vLLM's sampling parameter of that name allows; ``max_tokens``
    cuts the answer short, which is reported as ``"length"``.
    """
    limit = MAX_OUTPUT_TOKENS if max_tokens is None else max(1, min(max_tokens, MAX_OUTPUT_TOKENS))
    wanted = limit if ignore_eos else max(default_tokens, min_tokens)
    if wanted >= limit:
        return limit, "length"
    return wanted, "stop"


@dataclass(slots=True)
class LatencyHistogram:
    """Bucketed observations with Prometheus semantics (``le`` bounds, cumulative on output)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            # One slot per bound plus the +Inf overflow.
            self.counts = [0] * (len(self.bounds) + 1)

    @property
    def count(self) -> int:
        """Number of observations."""
        return sum(self.counts)

    def observe(self, value: float) -> None:
        """Record one observation."""
        self.total += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, count of observations <= le)`` pairs, ending with ``+Inf``."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out


@dataclass(frozen=True, slots=True)
class Generation:
    """The outcome of one request, in profile seconds."""

    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str
    ttft_s: float
    e2e_s: float


class ReplicaEngine:
    """One fake vLLM replica's state: its prefix cache, its queue and its counters.

    Latencies recorded in the histograms are in profile seconds (wall seconds divided by
    ``profile.time_scale``), so a replica run ten times faster still reports the profile's figures.
    """

    def __init__(self, profile: ReplicaProfile, *, clock: Clock = time.monotonic, sleep: Sleep = asyncio.sleep) -> None:
        self.profile = profile
        self.cache = PrefixCache(profile.num_gpu_blocks, profile.block_size)
        self._clock = clock
        self._sleep = sleep
        self._slots = asyncio.Semaphore(profile.max_running)
        self._prefill = asyncio.Lock()
        self.waiting = 0
        self.running = 0
        self.preemptions = 0
        self.prompt_tokens_total = 0
        self.cached_prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished: dict[str, int] = dict.fromkeys(FINISHED_REASONS, 0)
        self.ttft = LatencyHistogram(TTFT_BUCKETS)
        self.e2e = LatencyHistogram(E2E_BUCKETS)
        # Blocks that running requests need at once (shared prompt blocks + their own), and the
        # part of those not held by the prefix cache (partial prompt tail and output).
        self._held_blocks = 0
        self._private_blocks = 0

    @property
    def kv_cache_usage_perc(self) -> float:
        """Fraction of KV blocks in use, cached blocks included, at most 1.0."""
        used = len(self.cache) + self._private_blocks
        return min(1.0, used / self.profile.num_gpu_blocks)

    def reset_prefix_cache(self) -> None:
        """Drop every cached block (the counters keep their totals)."""
        self.cache.reset()

    async def generate(
        self,
        prompt: str,
        model: str,
        *,
        max_tokens: int | None = None,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        on_token: OnToken | None = None,
    ) -> Generation:
        """Serve one request: queue, prefill (serialised), then decode, calling ``on_token`` per token.

        If ``on_token`` raises or the task is cancelled (a client went away), the request is
        counted as aborted and its slot and blocks are released.
        """
        count, reason = output_budget(self.profile.default_output_tokens, max_tokens, min_tokens, ignore_eos)
        prompt_tokens = count_tokens(prompt)
        hashes = self.cache.hashes_for(prompt, model)
        scale = self.profile.time_scale
        started = self._clock()
        self.waiting += 1
        admitted = done = False
        held = private = 0
        try:
            async with self._slots:
                async with self._prefill:
                    self.waiting -= 1
                    admitted = True
                    self.running += 1
                    # Looked up when the prefill starts, not on arrival: a request queued behind
                    # another with the same prefix profits from it, as in vLLM.
                    cached_blocks = self.cache.match_and_store(hashes, prompt_tokens)
                    cached_tokens = min(cached_blocks * self.profile.block_size, prompt_tokens)
                    held, private = self._allocate(len(hashes), prompt_tokens, count)
                    self.prompt_tokens_total += prompt_tokens
                    self.cached_prompt_tokens_total += cached_tokens
                    await self._sleep(self.profile.prefill_seconds(prompt_tokens - cached_tokens) * scale)
                first = self._clock()
                ttft = (first - started) / scale
                self.ttft.observe(ttft)
                text = await self._decode(count, first, on_token)
                e2e = (self._clock() - started) / scale
                self.e2e.observe(e2e)
                done = True
        finally:
            if admitted:
                self.running -= 1
                self._held_blocks -= held
                self._private_blocks -= private
            else:
                self.waiting -= 1
            self.finished[reason if done else "abort"] += 1
        return Generation(
            text=text,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            completion_tokens=count,
            finish_reason=reason,
            ttft_s=ttft,
            e2e_s=e2e,
        )

    async def _decode(self, count: int, first: float, on_token: OnToken | None) -> str:
        """Emit ``count`` tokens, the first at ``first`` and then one per decode step."""
        pieces: list[str] = []
        step = self.profile.decode_s_per_token * self.profile.time_scale
        for i in range(count):
            if i:
                # Against a deadline rather than sleeping a step each time, so sleep overheads
                # do not add up over long answers.
                await self._sleep(max(0.0, first + i * step - self._clock()))
            token = filler_token(i)
            pieces.append(token)
            self.generation_tokens_total += 1
            if on_token is not None:
                await on_token(i, token)
        return "".join(pieces)

    def _allocate(self, prompt_blocks: int, prompt_tokens: int, output_tokens: int) -> tuple[int, int]:
        """Reserve a request's blocks; returns ``(held, private)`` to release when it ends.

        When running requests together need more blocks than the GPU has, vLLM preempts one; the
        fake only counts that (the victim is not slowed down), which is enough to see the pressure.
        """
        bs = self.profile.block_size
        private = math.ceil((prompt_tokens - prompt_blocks * bs + output_tokens) / bs)
        held = prompt_blocks + private
        if self._held_blocks + held > self.profile.num_gpu_blocks:
            self.preemptions += 1
        self._held_blocks += held
        self._private_blocks += private
        return held, private

    def metrics_text(self, model_name: str) -> bytes:
        """The Prometheus text exposition page, with vLLM's metric names and labels."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_VllmCollector(self, model_name))
        return generate_latest(registry)


class _VllmCollector(Collector):
    """Renders an engine's state as vLLM's metric families (collected on each scrape)."""

    def __init__(self, engine: ReplicaEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        e = self.engine
        labels = ["model_name", "engine"]
        values = [self.model_name, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def histogram(name: str, doc: str, hist: LatencyHistogram) -> HistogramMetricFamily:
            family = HistogramMetricFamily(name, doc, labels=labels)
            family.add_metric(values, hist.cumulative(), hist.total)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", e.running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", e.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kv_cache_usage_perc)
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            e.cache.queries_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", e.cache.hits_tokens
        )
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", e.preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", e.prompt_tokens_total)
        yield counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            e.cached_prompt_tokens_total,
        )
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", e.generation_tokens_total)
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*labels, "finished_reason"],
        )
        for reason, n in e.finished.items():
            success.add_metric([*values, reason], n)
        yield success
        yield histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", e.ttft)
        yield histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", e.e2e)
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*labels, "block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        info.add_metric([*values, str(e.profile.block_size), str(e.profile.num_gpu_blocks), "True"], 1.0)
        yield info
