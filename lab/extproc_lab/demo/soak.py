"""The soak: a fixed request rate through real Envoy for a long time, with sessions coming and
going, while the processor's memory and the sizes of its bounded structures are sampled.

The bounds are scaled down from the defaults (a 10-minute session TTL and 100,000 sessions would
take longer than the run to fill) so that every bounded structure reaches its steady state during
the warm-up: the session map through its TTL, the prefix index through its per-replica bound, the
rebalancer's session ledger through its own. After the warm-up nothing should grow; the report
compares the processor's resident memory then and at the end, and checks every size against its
bound. ``benchmarks/soak.py`` runs it for ten minutes; ``tests/e2e/test_soak.py`` for sixteen seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from extproc_lab.demo.fault_matrix import client, processor_rss, with_config
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.load import Outcome, RateStats, fixed_rate, lost, read_metrics, total
from extproc_lab.stats import percentile


@dataclass(frozen=True, slots=True)
class SoakSettings:
    """What the soak runs; the defaults are the ten-minute benchmark's."""

    duration_s: float = 600.0
    warmup_s: float = 120.0
    rate: float = 40.0  # requests a second, on a fixed schedule
    concurrency: int = 64  # at most this many in flight (a tick beyond it is counted as skipped)
    pool: int = 60  # idle conversations waiting for their next turn (think time ~ pool / rate)
    turns: tuple[int, int] = (1, 10)  # a conversation's length, uniform
    prefix_chars: int = 4000  # each conversation's own opening (~1,000 tokens, 62 prefix blocks)
    replicas: int = 4
    sample_every_s: float = 5.0
    session_ttl_s: float = 30.0
    max_sessions: int = 5000
    blocks_per_replica: int = 2000
    ledger_sessions: int = 500
    seed: int = 1

    def router_yaml(self) -> str:
        """The processor's config: the bounds under test."""
        return (
            f"sessions:\n  ttl_s: {self.session_ttl_s}\n  max_sessions: {self.max_sessions}\n"
            f"prefix:\n  blocks_per_replica: {self.blocks_per_replica}\n"
            f"rebalance:\n  ledger_sessions: {self.ledger_sessions}\n"
        )


SHORT = SoakSettings(
    duration_s=16.0,
    warmup_s=6.0,
    rate=40.0,
    pool=40,
    turns=(1, 6),
    sample_every_s=1.0,
    session_ttl_s=4.0,
    max_sessions=120,
    blocks_per_replica=400,
    ledger_sessions=60,
    prefix_chars=16_000,  # request-sized leaks stand out (tests/e2e/test_soak.py)
)


@dataclass(frozen=True, slots=True)
class Sample:
    """One look at the processor."""

    at_s: float  # since the start of the load
    rss_bytes: int
    sessions: int
    prefix_blocks: int
    ledger_sessions: int
    ledger_bytes: int
    requests: int  # answered so far


def least_squares_slope(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of ``(x, y)`` points; 0.0 for fewer than two or no spread in x."""
    if len(points) < 2:
        return 0.0
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


@dataclass
class SoakReport:
    """What the soak saw."""

    settings: SoakSettings
    samples: list[Sample] = field(default_factory=list)
    requests: int = 0
    lost: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    skipped: int = 0
    sessions_started: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    stream_errors: float = 0.0
    store_errors: float = 0.0
    elapsed_s: float = 0.0

    def after_warmup(self) -> list[Sample]:
        """Samples taken after the warm-up."""
        return [s for s in self.samples if s.at_s >= self.settings.warmup_s]

    @property
    def rss_warm(self) -> int:
        """Resident memory at the end of the warm-up (the first sample after it)."""
        after = self.after_warmup()
        return after[0].rss_bytes if after else 0

    @property
    def rss_end(self) -> int:
        """Resident memory at the end (the last sample)."""
        return self.samples[-1].rss_bytes if self.samples else 0

    @property
    def rss_max_after_warmup(self) -> int:
        """The highest resident memory seen after the warm-up."""
        return max((s.rss_bytes for s in self.after_warmup()), default=0)

    @property
    def growth_bytes(self) -> int:
        """End minus end-of-warm-up."""
        return self.rss_end - self.rss_warm

    def slope_bytes_per_min(self) -> float:
        """Least-squares slope of resident memory over the samples after the warm-up."""
        return least_squares_slope([(s.at_s / 60.0, float(s.rss_bytes)) for s in self.after_warmup()])

    def peaks(self) -> dict[str, int]:
        """The largest size of each bounded structure over the whole run."""
        return {
            "sessions": max((s.sessions for s in self.samples), default=0),
            "prefix_blocks": max((s.prefix_blocks for s in self.samples), default=0),
            "ledger_sessions": max((s.ledger_sessions for s in self.samples), default=0),
        }

    def bounds(self) -> dict[str, int]:
        """The bound of each structure (the prefix index holds at most the per-replica bound on
        each replica, so distinct blocks are at most that times the replicas)."""
        s = self.settings
        return {
            "sessions": s.max_sessions,
            "prefix_blocks": s.blocks_per_replica * s.replicas,
            "ledger_sessions": s.ledger_sessions,
        }

    def to_dict(self) -> dict[str, Any]:
        """Everything, for JSON."""
        out = asdict(self)
        out.update(
            rss_warm=self.rss_warm,
            rss_end=self.rss_end,
            rss_max_after_warmup=self.rss_max_after_warmup,
            growth_bytes=self.growth_bytes,
            slope_bytes_per_min=round(self.slope_bytes_per_min()),
            peaks=self.peaks(),
            bounds=self.bounds(),
        )
        return out


async def _sample(http: aiohttp.ClientSession, gw: LocalGateway, start: float, answered: int) -> Sample | None:
    rss = processor_rss(gw)
    if rss is None:
        return None
    m = await read_metrics(http, gw.metrics_url)
    return Sample(
        at_s=round(time.monotonic() - start, 2),
        rss_bytes=rss,
        sessions=int(m.get("extproc_sessions{}", 0)),
        prefix_blocks=int(m.get("extproc_prefix_index_blocks{}", 0)),
        ledger_sessions=int(m.get("extproc_session_ledger_sessions{}", 0)),
        ledger_bytes=int(m.get("extproc_session_ledger_bytes{}", 0)),
        requests=answered,
    )


async def run_soak(settings: SoakSettings = SHORT, log_dir: Path | None = None, progress: bool = False) -> SoakReport:
    """Run the soak and return its report (every process it started is stopped by PID)."""
    report = SoakReport(settings)
    outcomes: list[Outcome] = []
    stats = RateStats()
    gw = with_config(LocalGateway(replicas=settings.replicas, time_scale=0.02, log_dir=log_dir), settings.router_yaml())
    with gw:
        async with client() as http:
            start = time.monotonic()
            load = asyncio.create_task(
                fixed_rate(
                    http,
                    gw.url,
                    outcomes,
                    rate=settings.rate,
                    duration_s=settings.duration_s,
                    concurrency=settings.concurrency,
                    pool=settings.pool,
                    turns=settings.turns,
                    prefix_chars=settings.prefix_chars,
                    seed=settings.seed,
                    stats=stats,
                )
            )
            while not load.done():
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    sample = await _sample(http, gw, start, len(outcomes))
                    if sample is not None:
                        report.samples.append(sample)
                        if progress:
                            print(
                                f"{sample.at_s:7.1f}s rss {sample.rss_bytes / 2**20:6.1f} MiB  sessions "
                                f"{sample.sessions:5d}  prefix blocks {sample.prefix_blocks:6d}  ledger "
                                f"{sample.ledger_sessions:4d}  answered {sample.requests}",
                                flush=True,
                            )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(load), settings.sample_every_s)
            await load
            final = await _sample(http, gw, start, len(outcomes))
            if final is not None:
                report.samples.append(final)
            metrics = await read_metrics(http, gw.metrics_url)
    report.elapsed_s = round(time.monotonic() - start, 1)
    report.requests = len(outcomes)
    report.lost = len(lost(outcomes))
    report.statuses = dict(sorted(Counter(o.status for o in outcomes).items()))
    report.skipped = stats.skipped
    report.sessions_started = stats.sessions
    report.p50_ms = round(percentile((o.latency_s for o in outcomes), 0.5) * 1000, 1)
    report.p99_ms = round(percentile((o.latency_s for o in outcomes), 0.99) * 1000, 1)
    report.stream_errors = total(metrics, "extproc_stream_errors_total")
    report.store_errors = total(metrics, "extproc_store_errors_total")
    return report
