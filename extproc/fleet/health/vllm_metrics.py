"""What a vLLM replica's ``/metrics`` page says, parsed with prometheus_client's parser.

Names are vLLM's (V1 engine, 0.32 and 0.33; a sample page is tests/data/vllm_metrics_sample.txt), with the
older ``vllm:gpu_cache_usage_perc`` read when ``vllm:kv_cache_usage_perc`` is absent. Series of several
engines (data parallel, label ``engine="0"``, ``"1"``...) or models (label ``model_name``) are summed
(queues, counters) or maxed (KV usage).

What the engine writes, and what it means here:

- ``vllm:num_requests_waiting`` is the whole queue; ``vllm:num_requests_waiting_by_reason``
  (``reason="capacity"|"deferred"``) splits the same requests and is not added again;
- ``vllm:kv_cache_usage_perc`` counts the blocks running requests hold: 0 on an idle engine even
  when its prefix cache is full, so it is a load signal, never a measure of what is cached;
- counters are read as ``<name>_total`` (their ``_created`` series are ignored); a page without the
  prefix-cache counters (an older engine, prefix caching off, a proxy in front) parses to None for
  them, never to 0: "no hits" and "not reported" must stay apart for whoever judges the hit ratio;
- ``vllm:cache_config_info`` carries the cache layout in its labels (``block_size``,
  ``num_gpu_blocks``, ``prefix_caching_hash_algo``, ``enable_prefix_caching``), and no
  ``model_name``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class LoraInfo:
    """``vllm:lora_requests_info``: adapters loaded and waiting, and how many may be loaded."""

    max_lora: int
    running: tuple[str, ...]
    waiting: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReplicaMetrics:
    """One scrape of one replica."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: float | None = None
    """``vllm:prefix_cache_queries_total``: prompt tokens looked up in the prefix cache, cumulative;
    None when the page does not report it."""
    prefix_hits: float | None = None
    """``vllm:prefix_cache_hits_total``: of those, tokens found cached, cumulative; None when absent."""
    preemptions: float = 0.0
    ttft_buckets: tuple[tuple[float, float], ...] = ()
    itl_sum: float | None = None
    """``vllm:inter_token_latency_seconds_sum``: seconds between consecutive tokens of a request,
    cumulative; None when the page does not report it."""
    itl_count: float | None = None
    """``vllm:inter_token_latency_seconds_count``: those gaps, counted."""
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    hash_algo: str | None = None
    """``prefix_caching_hash_algo`` of ``vllm:cache_config_info`` (sha256, sha256_cbor, xxhash...)."""
    lora: LoraInfo | None = None
    models: tuple[str, ...] = field(default=())

    @property
    def kv_capacity_tokens(self) -> int:
        """The KV cache in tokens (``vllm:cache_config_info``: blocks times block size), 0 unknown."""
        return (self.num_gpu_blocks or 0) * (self.block_size or 0)


class MetricsPageError(ValueError):
    """The page is not a Prometheus exposition, or has none of vLLM's load gauges."""


_WANTED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:cache_config_info",
    "vllm:lora_requests_info",
)


def _relevant_lines(text: str) -> str:
    """Only the series the router reads, with their TYPE lines: a full vLLM page has hundreds of
    histogram lines the router never looks at, and the parser's cost is per line."""
    keep = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name = line[7:].split(" ", 1)[0]
        elif line.startswith("#") or not line:
            continue
        else:
            name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.startswith(_WANTED) and not name.endswith(("_created", "_by_reason")):
            keep.append(line)
    return "\n".join(keep) + "\n"


def _adapters(value: str) -> tuple[str, ...]:
    return tuple(a for a in value.split(",") if a)


def parse_vllm_metrics(text: str) -> ReplicaMetrics:
    """Parse a /metrics page; raises :class:`MetricsPageError` when it is unusable."""
    running = waiting = 0.0
    kv: float | None = None
    legacy_kv: float | None = None
    queries: float | None = None
    hits: float | None = None
    preemptions = 0.0
    buckets: dict[float, float] = {}
    itl_sum: float | None = None
    itl_count: float | None = None
    block_size = num_blocks = None
    hash_algo: str | None = None
    lora: tuple[float, LoraInfo] | None = None
    models: set[str] = set()
    seen_load = False
    try:
        for family in text_string_to_metric_families(_relevant_lines(text)):
            for sample in family.samples:
                name, labels, value = sample.name, sample.labels, sample.value
                if not name.startswith("vllm:") or math.isnan(value):
                    continue
                if "model_name" in labels:
                    models.add(labels["model_name"])
                if name == "vllm:num_requests_running":
                    running += value
                    seen_load = True
                elif name == "vllm:num_requests_waiting":
                    waiting += value
                    seen_load = True
                elif name == "vllm:kv_cache_usage_perc":
                    kv = value if kv is None else max(kv, value)
                elif name == "vllm:gpu_cache_usage_perc":
                    legacy_kv = value if legacy_kv is None else max(legacy_kv, value)
                elif name == "vllm:prefix_cache_queries_total":
                    queries = value + (queries or 0.0)
                elif name == "vllm:prefix_cache_hits_total":
                    hits = value + (hits or 0.0)
                elif name == "vllm:num_preemptions_total":
                    preemptions += value
                elif name == "vllm:time_to_first_token_seconds_bucket":
                    le = float(labels.get("le", "inf"))
                    buckets[le] = buckets.get(le, 0.0) + value
                elif name == "vllm:inter_token_latency_seconds_sum":
                    itl_sum = value + (itl_sum or 0.0)
                elif name == "vllm:inter_token_latency_seconds_count":
                    itl_count = value + (itl_count or 0.0)
                elif name == "vllm:cache_config_info":
                    block_size = _int(labels.get("block_size"), block_size)
                    num_blocks = _int(labels.get("num_gpu_blocks"), num_blocks)
                    hash_algo = labels.get("prefix_caching_hash_algo") or hash_algo
                elif name == "vllm:lora_requests_info":
                    info = LoraInfo(
                        max_lora=_int(labels.get("max_lora"), 0) or 0,
                        running=_adapters(labels.get("running_lora_adapters", "")),
                        waiting=_adapters(labels.get("waiting_lora_adapters", "")),
                    )
                    # Several series may linger; the newest (largest timestamp value) is current.
                    if lora is None or value > lora[0]:
                        lora = (value, info)
    except ValueError as exc:
        raise MetricsPageError(f"not a Prometheus exposition: {exc}") from None
    if not seen_load:
        raise MetricsPageError("no vllm:num_requests_running / vllm:num_requests_waiting on the page")
    usage = kv if kv is not None else legacy_kv if legacy_kv is not None else 0.0
    return ReplicaMetrics(
        # A count below zero is a broken exporter; taken as is it would make the replica look
        # emptier than idle and draw every new session (the load scorer ranks by distance from
        # the lightest), so counts are clamped as KV usage is.
        running=max(0, int(running)),
        waiting=max(0, int(waiting)),
        kv_usage=min(1.0, max(0.0, usage)),
        prefix_queries=queries,
        prefix_hits=hits,
        preemptions=preemptions,
        ttft_buckets=tuple(sorted(buckets.items())),
        itl_sum=itl_sum,
        itl_count=itl_count,
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        hash_algo=hash_algo,
        lora=lora[1] if lora else None,
        models=tuple(sorted(models)),
    )


def _int(value: str | None, default: int | None) -> int | None:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def histogram_quantile(buckets: tuple[tuple[float, float], ...], q: float, min_count: float = 20.0) -> float | None:
    """The ``q`` quantile of a cumulative histogram (``(le, count)`` pairs), as Prometheus' own
    ``histogram_quantile`` does (linear within the bucket); None with fewer than ``min_count``."""
    if not buckets:
        return None
    total = buckets[-1][1]
    if total < min_count:
        return None
    rank = q * total
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower_le
            width = count - lower_count
            return lower_le + (le - lower_le) * ((rank - lower_count) / width if width else 1.0)
        lower_le, lower_count = le, count
    return buckets[-1][0]


def bucket_delta(
    newer: tuple[tuple[float, float], ...], older: tuple[tuple[float, float], ...]
) -> tuple[tuple[float, float], ...]:
    """Per-bucket increase between two scrapes (a counter reset counts from zero)."""
    old = dict(older)
    if any(count < old.get(le, 0.0) for le, count in newer):
        return newer  # the replica restarted: everything since is new
    return tuple((le, count - old.get(le, 0.0)) for le, count in newer)
