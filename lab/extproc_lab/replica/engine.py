"""The fake replica's engine: the replica model (:mod:`extproc_lab.replica.model`) driven in real or
scaled time, with vLLM's /metrics page.

No HTTP here: :meth:`ReplicaEngine.generate` takes a prompt and emits tokens through a callback,
and the clock and the sleep are injected, so tests can drive it in virtual time. One background
task steps the model while it has work: it plans a step (continuous batching: every running
sequence gets its next tokens, waiting prompts are admitted within the token budget), sleeps for
the step's duration, then hands each sequence its token. The simulator steps the very same model
on a virtual clock.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from extproc.api import Event
from extproc.api.sim import block_hashes, model_seed
from extproc_lab.replica.cache import count_tokens
from extproc_lab.replica.kv_events import KvEventRecorder, TokenBlocks
from extproc_lab.replica.model import (
    E2E_BUCKETS,
    FINISHED_REASONS,
    TTFT_BUCKETS,
    KVPool,
    LatencyHistogram,
    ReplicaModel,
    Seq,
)
from extproc_lab.replica.timing import ReplicaProfile

__all__ = [
    "E2E_BUCKETS",
    "FINISHED_REASONS",
    "MAX_OUTPUT_TOKENS",
    "TTFT_BUCKETS",
    "Generation",
    "KvSource",
    "LatencyHistogram",
    "ReplicaEngine",
    "filler_token",
    "output_budget",
]

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]
OnToken = Callable[[int, str], Awaitable[None]]
"""Called with (index, text) for each output token, as soon as it is produced."""
KvSource = Callable[[Seq], Awaitable[int]]
"""Fetches a request's KV blocks from elsewhere (disaggregated serving): given the request, returns
how many of its prompt's leading keys arrived (0: recompute them)."""

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


def filler_text(tokens: int) -> str:
    """The whole answer of ``tokens`` tokens, as the fake replica writes it."""
    return "".join(filler_token(i) for i in range(tokens))


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
    block_keys: tuple[int, ...] = ()
    """The prompt's full blocks' keys, as this replica cached them (what a KV transfer exports)."""


class ReplicaEngine:
    """One fake vLLM replica: a :class:`~extproc_lab.replica.model.ReplicaModel` stepped in real time.

    Model time is the clock divided by ``profile.time_scale``, so latencies in the histograms are
    in profile seconds: a replica run ten times faster still reports the profile's figures.
    """

    def __init__(
        self,
        profile: ReplicaProfile,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        token_blocks: TokenBlocks | None = None,
        publish: Callable[[Sequence[Event]], object] | None = None,
    ) -> None:
        self.profile = profile
        self.model = ReplicaModel(profile)
        self._clock = clock
        self._sleep = sleep
        self._stepper: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self.deferred = 0
        """Requests waiting for their KV blocks from a prefill replica (vLLM's ``deferred``)."""
        # With token ids (a tokenizer) the cache is keyed by vLLM's block hashes; with ``publish``
        # each step's stores and evictions go out as KV events when the step ends.
        self.token_blocks = token_blocks
        self.hash_algo = str(token_blocks.chain.algo) if token_blocks is not None else "sha256"
        """``--prefix-caching-hash-algo`` as ``vllm:cache_config_info`` reports it."""
        self.started_unix = time.time()
        self._publish = publish
        self._recorder: KvEventRecorder | None = None
        if publish is not None:
            self._recorder = recorder = KvEventRecorder(token_blocks)
            pool = self.model.pool
            pool.listener = recorder
            if pool.offload is not None:
                offload = pool.offload
                pool.offload.listener = recorder
                recorder.holds = lambda key: key in pool or key in offload

    # vLLM's gauges and counters, read from the model.

    @property
    def cache(self) -> KVPool:
        """The KV blocks and their prefix cache."""
        return self.model.pool

    @property
    def waiting(self) -> int:
        """Requests queued for admission."""
        return self.model.num_waiting

    @property
    def running(self) -> int:
        """Requests in the running batch (prefilling or decoding)."""
        return self.model.num_running

    @property
    def preemptions(self) -> int:
        """Sequences preempted for lack of KV blocks."""
        return self.model.preemptions

    @property
    def finished(self) -> dict[str, int]:
        """Finished requests by reason (``stop``, ``length``, ``abort``)."""
        return self.model.finished

    @property
    def ttft(self) -> LatencyHistogram:
        """Time to first token, profile seconds."""
        return self.model.ttft

    @property
    def e2e(self) -> LatencyHistogram:
        """End-to-end latency, profile seconds."""
        return self.model.e2e

    @property
    def kv_cache_usage_perc(self) -> float:
        """Fraction of KV blocks referenced by requests (cached blocks nobody uses are free)."""
        return self.model.kv_cache_usage_perc

    def reset_prefix_cache(self) -> None:
        """Drop every cached block no request uses (the counters keep their totals)."""
        self.model.reset_prefix_cache()
        self._flush_events()

    def _flush_events(self) -> None:
        recorder = self._recorder
        if recorder is not None and self._publish is not None and (recorder.pending or recorder.pending_offload):
            self._publish(recorder.drain())

    def hashes_for(self, prompt: str, model: str) -> tuple[int, ...]:
        """The prefix keys of ``prompt``'s full blocks: the router's block hashes, so what the
        router believes a replica holds and what it holds compare block for block."""
        bs = self.profile.block_size
        return block_hashes(prompt, model_seed(model), bs * 4, self.profile.num_gpu_blocks)

    def _now(self) -> float:
        return self._clock() / self.profile.time_scale

    async def generate(
        self,
        prompt: str,
        model: str,
        *,
        max_tokens: int | None = None,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        on_token: OnToken | None = None,
        token_ids: Sequence[int] | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        kv_source: KvSource | None = None,
    ) -> Generation:
        """Serve one request: queue, prefill, then decode in the shared batch, calling
        ``on_token`` per token.

        With ``kv_source`` (a decode replica given a prefill replica's blocks) the request first
        waits for the blocks it does not hold, which then count as cached: only what did not
        arrive is computed here.

        If ``on_token`` raises or the task is cancelled (a client went away), the request is
        counted as aborted and its blocks are released.
        """
        count, reason = output_budget(self.profile.default_output_tokens, max_tokens, min_tokens, ignore_eos)
        bs = self.profile.block_size
        tokens: asyncio.Queue[int] = asyncio.Queue()
        if token_ids is not None and self.token_blocks is not None:
            prompt_tokens = len(token_ids)
            keys = self.token_blocks.keys(token_ids, self.profile.num_gpu_blocks, lora_name, cache_salt)
        else:
            prompt_tokens, keys = count_tokens(prompt), self.hashes_for(prompt, model)
        seq = Seq(
            request_id=str(next(self._ids)),
            prompt_tokens=prompt_tokens,
            output_tokens=count,
            keys=keys,
            key_span=bs,
            tail_span=bs,
            finish_reason=reason,
            handle=tokens,
        )
        if kv_source is not None:
            self.deferred += 1
            try:
                received = await kv_source(seq)
            finally:
                self.deferred -= 1
            self.model.receive(seq, received)
            self._flush_events()
        self.model.submit(seq, self._now())
        self._wake()
        pieces: list[str] = []
        done = False
        try:
            for i in range(count):
                await tokens.get()
                token = filler_token(i)
                pieces.append(token)
                if on_token is not None:
                    await on_token(i, token)
            done = True
        finally:
            if not done:
                self.model.abort(seq, self._now())
        return Generation(
            text="".join(pieces),
            prompt_tokens=seq.prompt_tokens,
            cached_tokens=max(0, seq.cached_tokens),
            completion_tokens=count,
            finish_reason=reason,
            ttft_s=seq.first_token_at - seq.arrived_at,
            e2e_s=seq.finished_at - seq.arrived_at,
            block_keys=tuple(seq.keys),
        )

    def _wake(self) -> None:
        if self._stepper is None:
            self._stepper = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        """Step the model while it has work; sequences get their tokens at each step's end."""
        model = self.model
        scale = self.profile.time_scale
        try:
            while True:
                duration = model.begin_step(self._now())
                if duration is None:
                    return
                await self._sleep(duration * scale)
                for seq in model.end_step().emitted:
                    seq.handle.put_nowait(seq.generated - 1)
                self._flush_events()
                # Let the requests see their tokens before the next step starts (matters on a
                # virtual clock, where the next sleep moves time at once).
                await asyncio.sleep(0)
        finally:
            self._stepper = None

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
        self.created = engine.started_unix

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        e = self.engine
        labels = ["model_name", "engine"]
        values = [self.model_name, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            # vLLM's counters, with one API server, expose ``<name>_created`` beside ``<name>_total``.
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value, created=self.created)
            return family

        def histogram(
            name: str, doc: str, hist: LatencyHistogram
        ) -> Iterator[GaugeMetricFamily | HistogramMetricFamily]:
            family = HistogramMetricFamily(name, doc, labels=labels)
            family.add_metric(values, hist.cumulative(), hist.total)
            yield family
            yield gauge(f"{name}_created", doc, self.created)  # as a counter's, written as a gauge

        m = e.model
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", e.running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", e.waiting + e.deferred)
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason.", labels=[*labels, "reason"]
        )
        # A queued request waits for room in the batch or the cache; one waiting for its KV blocks
        # from a prefill replica is deferred, as vLLM counts it.
        by_reason.add_metric([*values, "capacity"], e.waiting)
        by_reason.add_metric([*values, "deferred"], e.deferred)
        yield by_reason
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kv_cache_usage_perc)
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            m.prefix_queries_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", m.prefix_hits_tokens
        )
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", e.preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", m.prompt_tokens_total)
        yield counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            m.cached_prompt_tokens_total,
        )
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", m.generation_tokens_total)
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*labels, "finished_reason"],
        )
        for reason, n in e.finished.items():
            success.add_metric([*values, reason], n, created=self.created)
        yield success
        yield from histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", e.ttft)
        yield from histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", e.e2e)
        # vLLM's buckets are not kept (see ReplicaModel.itl_total): one +Inf bucket, its sum and
        # count. In wall seconds, as vLLM's: the router sets it against the answers' wall time.
        itl = HistogramMetricFamily(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", labels=labels
        )
        itl.add_metric(values, [("+Inf", float(m.itl_count))], m.itl_total * e.profile.time_scale)
        yield itl
        # As vLLM writes it: the cache config's fields as labels, the engine's but no model_name.
        layout = {
            "block_size": str(e.profile.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "engine": "0",
            "gpu_memory_utilization": "0.9",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(e.profile.num_gpu_blocks),
            "prefix_caching_hash_algo": e.hash_algo,
        }
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=[*layout])
        info.add_metric(list(layout.values()), 1.0)
        yield info
