"""What the gateway knows about each replica: in-flight work it sent there, what the replica's
/metrics page said, what real traffic showed (status codes, time to first byte), and whether it is
in rotation.

In-flight counts change at decision time, not after the next scrape, so a burst of new sessions
spreads over replicas instead of herding onto the one that looked idle.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from extproc.fleet.health.record import ReplicaRecord
from extproc.fleet.health.rotation import step
from extproc.fleet.health.score import HealthSignals, fleet_baseline, health_score
from extproc.fleet.health.sessions import LiveSessions
from extproc.fleet.health.settings import HealthSettings
from extproc.fleet.health.shared_load import PeerCounts, PeerLoad
from extproc.fleet.health.vllm_metrics import ReplicaMetrics, bucket_delta, histogram_quantile
from extproc.fleet.health.working_sets import WorkingSets
from extproc.routing.model import Replica, ReplicaState, Snapshot

ERROR_EWMA_ALPHA = 0.1
_NO_PEERS = PeerCounts()
MIN_TTFT_SAMPLES = 20


@dataclass(frozen=True, slots=True)
class LoadReport:
    """A replica's load as the replica itself reports it (a simulator's direct report)."""

    queue: int = 0
    running: int = 0
    kv_usage: float = 0.0


@dataclass(frozen=True, slots=True)
class Transition:
    """A replica entered or left the rotation."""

    replica: str
    in_rotation: bool
    score: float


class ReplicaBook:
    """All replicas' records; produces the immutable :class:`Snapshot` each decision reads."""

    def __init__(
        self, replicas: Iterable[Replica], settings: HealthSettings | None = None, peers: PeerLoad | None = None
    ) -> None:
        self.settings = settings or HealthSettings()
        self.peers = peers
        """The other workers of this host (``serve --workers``): their in-flight load is added to ours."""
        self._records: dict[str, ReplicaRecord] = {r.name: ReplicaRecord(r) for r in replicas}
        # Ejections decided between evaluations (upstream failures seen by Envoy), reported by the
        # next evaluate() so that they are counted and their sessions moved like any other.
        self._unreported: list[Transition] = []
        self._baseline: HealthSignals | None = None  # the fleet's median load at the last evaluation
        self.sessions = LiveSessions()  # the conversations each replica carries (its pinned decode load)
        self.working_sets = WorkingSets()  # and the KV of their own they hold there, while due back
        self.scrapes = 0
        """Successful scrapes taken in so far (readers of ``metrics`` check it for news)."""

    def __contains__(self, name: str) -> bool:
        return name in self._records

    def __len__(self) -> int:
        return len(self._records)

    def records(self) -> list[ReplicaRecord]:
        """All records (for metrics and the scraper)."""
        return list(self._records.values())

    def record(self, name: str) -> ReplicaRecord | None:
        """Replica ``name``'s record, None when it is not a member."""
        return self._records.get(name)

    # --- membership ---------------------------------------------------------------------------

    def join(self, replica: Replica) -> bool:
        """Add a replica (or update its address/weight); True if it is new."""
        rec = self._records.get(replica.name)
        if rec is None:
            self._records[replica.name] = ReplicaRecord(replica)
            return True
        rec.replica = replica
        return False

    def leave(self, name: str) -> bool:
        """Remove a replica; True if it was a member."""
        self.sessions.forget(name)
        self.working_sets.forget(name)
        return self._records.pop(name, None) is not None

    # --- the decision's view --------------------------------------------------------------------

    def _decayed(self, rec: ReplicaRecord, now: float) -> float:
        if rec.recent == 0.0 or now <= rec.recent_at:
            return rec.recent
        return float(rec.recent * 0.5 ** ((now - rec.recent_at) / self.settings.recent_half_life_s))

    def snapshot(self, now: float, tenant_inflight: Mapping[tuple[str, str], int] | None = None) -> Snapshot:
        """Every replica's state at ``now``. Scraped load older than ``stale_after_s`` is not
        trusted: a replica whose page broke while it was busy must not look busy forever."""
        stale_before = now - self.settings.stale_after_s
        live = self.sessions.expected(now)
        live_tokens = self.sessions.tokens(now)
        working = self.working_sets.tokens(now)
        states = []
        peers = self.peers.others(now) if self.peers is not None else {}
        for r in self._records.values():
            fresh = r.scraped_at >= stale_before
            peer = peers.get(r.replica.name, _NO_PEERS)
            lora = r.metrics.lora if r.metrics is not None else None
            states.append(
                ReplicaState(
                    replica=r.replica,
                    in_rotation=r.rotation.in_rotation,
                    health=r.health,
                    inflight=r.inflight + peer.inflight,
                    inflight_tokens=r.inflight_tokens + peer.inflight_tokens,
                    pending_prefill_tokens=r.pending_prefill_tokens + peer.pending_prefill_tokens,
                    live_sessions=live.get(r.replica.name, 0),
                    live_session_tokens=live_tokens.get(r.replica.name, 0),
                    working_set_tokens=working.get(r.replica.name, 0),
                    recent_requests=self._decayed(r, now) + peer.recent,
                    queue=r.queue if fresh else 0,
                    running=r.running if fresh else 0,
                    kv_usage=r.kv_usage if fresh else 0.0,
                    kv_capacity_tokens=r.kv_capacity_tokens,
                    cache_fill=r.cache_fill,
                    adapters=frozenset(lora.running) if lora else frozenset(),
                    adapters_waiting=frozenset(lora.waiting) if lora else frozenset(),
                    max_lora=lora.max_lora if lora else 0,
                    models=frozenset(r.metrics.models) if r.metrics is not None else frozenset(),
                )
            )
        return Snapshot(tuple(states), tenant_inflight or {})

    # --- what the decision changes ----------------------------------------------------------------

    def begin(
        self,
        name: str,
        now: float,
        prefill_tokens: int = 0,
        kv_tokens: int = 0,
        session: str | None = None,
        hold_s: float | None = None,
        declared: bool = True,
    ) -> None:
        """A request was sent to ``name``: ``prefill_tokens`` of its prompt to prefill there, the
        ``kv_tokens`` of KV it adds there (its prompt's part not believed cached), a turn of ``session``
        if any (``declared`` False: a keyless request opening a conversation, :meth:`LiveSessions.begin`)."""
        rec = self._records.get(name)
        if rec is not None:
            if session is not None:
                self.sessions.begin(name, session, now, hold_s, kv_tokens, declared)
                self.working_sets.begin(name, session, now, kv_tokens)
            rec.recent = self._decayed(rec, now) + 1.0
            rec.recent_at = now
            rec.inflight += 1
            rec.inflight_tokens += kv_tokens
            rec.written_tokens += kv_tokens
            rec.requests += 1
            rec.pending_prefill_tokens += prefill_tokens
            if self.peers is not None:
                self.peers.publish(rec)

    def hop(self, name: str, prefill_tokens: int) -> None:
        """A prefill hop was asked of ``name`` for a request another replica decodes: about
        ``prefill_tokens`` of its prompt, uncached there, wait there until :meth:`prefilled`, and
        fill its cache (the request itself is counted in flight on its decode replica)."""
        rec = self._records.get(name)
        if rec is not None:
            rec.pending_prefill_tokens += prefill_tokens
            rec.written_tokens += prefill_tokens
            if self.peers is not None:
                self.peers.publish(rec)

    def prefilled(self, name: str, prefill_tokens: int) -> None:
        """The first byte came back: that request's prefill is done."""
        rec = self._records.get(name)
        if rec is not None:
            rec.pending_prefill_tokens = max(0, rec.pending_prefill_tokens - prefill_tokens)
            if self.peers is not None:
                self.peers.publish(rec)

    def end(self, name: str, now: float, prefill_tokens: int, kv_tokens: int, session: str | None = None) -> None:
        """A request to ``name`` finished (or was abandoned) at ``now``; ``prefill_tokens`` still
        pending are dropped and the ``kv_tokens`` it held are freed."""
        rec = self._records.get(name)
        if session is not None:
            self.sessions.end(session)
            self.working_sets.end(session, now)
        if rec is not None and rec.inflight > 0:
            rec.inflight -= 1
            rec.inflight_tokens = max(0, rec.inflight_tokens - kv_tokens)
            rec.pending_prefill_tokens = max(0, rec.pending_prefill_tokens - prefill_tokens)
            if self.peers is not None:
                self.peers.publish(rec)

    # --- what the world says -------------------------------------------------------------------

    def apply_report(self, name: str, report: LoadReport, now: float = math.inf) -> None:
        """Take in a replica's own report of its load (a simulator, or a test). Without ``now``
        the report counts as fresh until the next one, as for a simulator that reports on change."""
        rec = self._records.get(name)
        if rec is not None:
            rec.queue, rec.running, rec.kv_usage = report.queue, report.running, report.kv_usage
            rec.scraped_at = now
            rec.scrape_failures = 0
            rec.refused = False

    def apply_scrape(self, name: str, metrics: ReplicaMetrics, now: float) -> None:
        """Take in one successful scrape of the replica's /metrics page."""
        rec = self._records.get(name)
        if rec is None:
            return
        rec.queue, rec.running, rec.kv_usage = metrics.waiting, metrics.running, metrics.kv_usage
        last = rec.metrics
        if last is not None and metrics.itl_count is not None and last.itl_count is not None:
            gaps = metrics.itl_count - last.itl_count
            if gaps > 0:  # below zero: the engine restarted, its counters with it
                rec.inter_token_s = max(0.0, (metrics.itl_sum or 0.0) - (last.itl_sum or 0.0)) / gaps
        if _restarted(last, metrics):
            # A new engine under the same name, its cache empty: what it holds is what it computed
            # since it started, its own count (the ledger's writes were the old engine's).
            rec.written_tokens = int(max(0.0, (metrics.prefix_queries or 0.0) - (metrics.prefix_hits or 0.0)))
        rec.metrics = metrics
        self.scrapes += 1
        rec.scraped_at = now
        rec.scrape_failures = 0
        rec.refused = False
        if metrics.ttft_buckets:
            rec.ttft_history.append((now, metrics.ttft_buckets))

    def scrape_failed(self, name: str, refused: bool, *, timed_out: bool = False, now: float | None = None) -> None:
        """A scrape failed: broken page, (``refused``) nothing listening, or (``timed_out``) no page
        within the budget. A page that is late while the replica answers requests (Envoy saw one
        answered within ``stale_after_s`` before ``now``), or while requests sent to it are still
        running, is a busy replica's, not a dead one's: a CPU engine busy prefilling answers
        /metrics late, and counting that as unreachable ejected a working engine under load (on
        real vLLM, one of three, which then served 19 of 144 requests; again at 27 live
        conversations, with long prefills running and no new answer for two seconds). It is no
        failure; its load figures simply age. A replica that really hung is judged by those
        requests: they meet the first-byte or idle timeout and fail, and failures eject it."""
        rec = self._records.get(name)
        if rec is None:
            return
        busy = rec.inflight > 0 or (now is not None and rec.answered_at >= now - self.settings.stale_after_s)
        if timed_out and not refused and busy:
            return
        rec.scrape_failures += 1
        rec.refused = refused

    def inter_token_s(self, name: str) -> float | None:
        """Replica ``name``'s recent mean gap between two tokens of a request, as its engine reports
        it (None: not reported, or no token generated since the router began scraping)."""
        rec = self._records.get(name)
        return rec.inter_token_s if rec is not None else None

    def observe_first_token(self, name: str, ttft_s: float, now: float) -> None:
        """A streamed answer's first token came ``ttft_s`` after it was sent (for the TTFT p99 the
        replica is judged on; its headers, sent at once by vLLM, tell nothing of it)."""
        rec = self._records.get(name)
        if rec is not None and ttft_s >= 0.0:
            rec.observed_ttfb.append((now, ttft_s))

    def observe(self, name: str, status: int, ttfb_s: float | None, now: float) -> None:
        """Learn from a response seen by Envoy: its status and its time to first byte."""
        rec = self._records.get(name)
        if rec is None:
            return
        failed = status == 0 or status in (502, 503, 504)
        rec.error_rate += ERROR_EWMA_ALPHA * ((1.0 if failed or status >= 500 else 0.0) - rec.error_rate)
        if failed:
            rec.errors += 1
            rec.upstream_failures += 1
        else:
            rec.upstream_failures = 0
            if status:
                rec.answered_at = now
            if ttfb_s is not None:
                rec.observed_ttfb.append((now, ttfb_s))
        if rec.upstream_failures >= self.settings.upstream_fail_after:
            # Envoy saw this replica fail several times in a row: do not wait for the next evaluation.
            transition = self._evaluate_one(rec, now, hard_failure=True)
            if transition is not None:
                self._unreported.append(transition)
            rec.upstream_failures = 0

    # --- judging ------------------------------------------------------------------------------

    def ttft_p99(self, rec: ReplicaRecord, now: float) -> float | None:
        """Recent TTFT p99: the worse of the replica's own histogram (delta over the window) and
        the time to first byte Envoy saw. Either needs enough samples: one slow request is noise."""
        window_start = now - self.settings.ttft_window_s
        candidates = []
        history = [h for h in rec.ttft_history if h[0] >= window_start]
        if len(history) >= 2:
            delta = bucket_delta(history[-1][1], history[0][1])
            q = histogram_quantile(delta, 0.99, MIN_TTFT_SAMPLES)
            if q is not None:
                candidates.append(q)
        observed = sorted(t for at, t in rec.observed_ttfb if at >= window_start)
        if len(observed) >= MIN_TTFT_SAMPLES:
            candidates.append(observed[min(len(observed) - 1, math.ceil(0.99 * len(observed)) - 1)])
        return max(candidates) if candidates else None

    def signals(self, rec: ReplicaRecord, now: float) -> HealthSignals:
        """The inputs of a replica's health score."""
        fresh = rec.scraped_at >= now - self.settings.stale_after_s
        return HealthSignals(
            queue=rec.queue if fresh else 0,
            kv_usage=rec.kv_usage if fresh else 0.0,
            ttft_p99_s=self.ttft_p99(rec, now),
            error_rate=rec.error_rate,
            scrape_failures=rec.scrape_failures,
        )

    def _evaluate_one(
        self, rec: ReplicaRecord, now: float, hard_failure: bool = False, signals: HealthSignals | None = None
    ) -> Transition | None:
        s = self.settings
        signals = signals or self.signals(rec, now)
        rec.health = health_score(signals, s.weights, s.limits, self._baseline)
        before = rec.rotation.in_rotation
        rec.rotation = step(rec.rotation, rec.health, now, s.rotation, hard_failure=hard_failure or rec.refused)
        if rec.rotation.in_rotation != before:
            if not rec.rotation.in_rotation:
                # Its sessions move away: the recent traffic that stood for them no longer applies,
                # and it must not keep the replica looking busy when it comes back.
                rec.recent = 0.0
                # Out of rotation it gets no traffic, so what traffic showed of it (errors, slow
                # first bytes) could never improve and would keep it out for good: the ejection
                # has judged that; readmission is judged on what it shows from now on. A replica
                # still failing once back is ejected again by its first failures in a row.
                rec.error_rate = 0.0
                rec.upstream_failures = 0
                rec.observed_ttfb.clear()
                rec.ttft_history.clear()
            return Transition(rec.replica.name, rec.rotation.in_rotation, rec.health)
        return None

    def evaluate(self, now: float) -> list[Transition]:
        """Score every replica and step its rotation state; returns the replicas that changed."""
        out, self._unreported = self._unreported, []
        records = list(self._records.values())
        signals = [self.signals(rec, now) for rec in records]
        # Load is judged against the fleet's median replica (in rotation and scraped): when every
        # replica is busy the fleet is overloaded, and no replica is ejected for being as busy as
        # the rest (shared-prefix at 6,000 blocks, seed 11: five of eight were, and the other
        # three took everything, a TTFT p99 above round robin's).
        self._baseline = fleet_baseline(
            [
                sig
                for rec, sig in zip(records, signals, strict=True)
                if rec.rotation.in_rotation and not rec.scrape_failures
            ]
        )
        for rec, sig in zip(records, signals, strict=True):
            t = self._evaluate_one(rec, now, signals=sig)
            if t is not None:
                out.append(t)
        return out


def _restarted(last: ReplicaMetrics | None, now: ReplicaMetrics) -> bool:
    """Whether the engine restarted between two scrapes: its prefix-cache lookups, a counter
    that only grows while it runs, went back."""
    if last is None or last.prefix_queries is None or now.prefix_queries is None:
        return False
    return now.prefix_queries < last.prefix_queries
