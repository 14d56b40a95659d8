"""Hot-key detection: sampled fingerprints, counted per window in a bucketed heavy-hitter sketch.

Each request's fingerprint is the 64-bit hash of its prefix ring key (the deepest prefix block that
tells requests apart, in its tenant's key space: :meth:`extproc.routing.pipeline.Profile.prefix_key`).
One request in ``1 / sample_rate`` is sampled (the gaps between samples are drawn from a geometric
distribution with the random source passed in, so the unsampled ones cost a decrement and a run is
reproducible for a seed). A sampled fingerprint goes to one of ``buckets`` buckets by its low bits;
a bucket keeps, for the current window, its sampled count, a 64-bit linear-counting mask of the
distinct fingerprints it saw, and its top ``per_bucket`` fingerprints by count (space-saving: a
newcomer to a full bucket replaces the smallest entry and inherits its count as its error).

As each window (``window_s``) closes, every kept fingerprint is compared with the mean count per
key: its guaranteed count (count minus error) against ``threshold`` times the mean count per other
key hashed into its bucket (the bucket's count without this key's, over its distinct keys but this
one). A bucket with fewer than ``_MIN_PEERS`` other keys has no mean worth the name (a fleet with
tens of prefixes puts most of them alone in a bucket, and one neighbour's count is noise): then the
same mean over all buckets together stands in; with many keys per bucket the two agree. A
sample drawn at 0.5% makes small counts noise, so a key also needs ``min_samples``. A key above
the bar for ``windows`` consecutive windows turns hot; a hot key below it for as many windows
cools; a cooled key keeps a replica set for ``linger_windows``, sized by its own rate (k = 1 once
its traffic is gone, so it gathers back on one copy), then is routed as any other. Memory is
bounded whatever the traffic: ``buckets * per_bucket`` entries, one mask and one count per bucket,
a streak per kept entry, at most ``max_hot`` hot and as many cooling keys; CPU per request is
constant, and a window's close walks the kept entries only.

The clock is passed in (``now`` arguments), the random source at construction: the detector does
no I/O and reads no clock of its own.
"""

from __future__ import annotations

import math
import random
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field

from extproc.base.validation import Section, option
from extproc.routing.hot import fingerprint

_MASK_BITS = 64
_MIN_PEERS = 8


def label(fp: int) -> str:
    """A fingerprint as a metric label or list entry: 16 hex digits."""
    return f"{fp:016x}"


class HotKeySettings(Section):
    """``hot_keys:``: find prefixes that carry a disproportionate share and serve each from k replicas.

    ``linger_windows``: a cooled key keeps a replica set sized by its rate (k = 1 without traffic)
    this many windows before it is routed as any other.
    """

    enabled: bool = option(False, "sample prefix fingerprints and spread hot prefixes")
    sample_rate: float = option(0.005, "share of requests whose fingerprint is counted", gt=0, le=1)
    window_s: float = option(10.0, "length of a counting window", gt=0)
    buckets: int = option(1024, "buckets of the sketch (fingerprints hashed into them)", ge=1)
    per_bucket: int = option(5, "top fingerprints kept per bucket", ge=1)
    threshold: float = option(8.0, "hot at this many times the mean count per key", gt=1)
    windows: int = option(2, "consecutive windows above (below) it to turn hot (cool)", ge=1)
    min_samples: int = option(8, "sampled requests a key needs in a window to be hot", ge=1)
    max_hot: int = option(32, "hot keys kept at most (also bounds the metric's labels)", ge=1)
    max_replicas: int = option(4, "replicas a hot prefix is spread over at most", ge=1)
    replica_prefill_tokens_per_s: float = option(
        20_000.0, "one replica's prefill capacity: a replica per this much demand", gt=0
    )
    linger_windows: int = option(6, "windows a cooled prefix keeps k by its own rate (1 without traffic)", ge=0)
    warm_on_join: bool = option(True, "send a joining replica the top hot prefixes, prefill only")
    warm_top: int = option(4, "hot prefixes a joining replica is warmed with at most", ge=0)
    warm_max_bytes: int = option(65_536, "a hot prefix's kept request body at most (bytes)", ge=1)


@dataclass(frozen=True, slots=True)
class HotKey:
    """A key found hot: its fingerprint, estimated rate and size, and how many replicas serve it."""

    fingerprint: int
    rate_rps: float
    tokens: float
    """Mean prompt tokens of its sampled requests."""
    replicas: int
    since: float

    @property
    def label(self) -> str:
        """The fingerprint in hex (metric label, admin list)."""
        return label(self.fingerprint)


@dataclass(slots=True)
class _Entry:
    count: int = 0
    error: int = 0
    tokens: int = 0


@dataclass(slots=True)
class _Bucket:
    total: int = 0
    mask: int = 0
    top: dict[int, _Entry] = field(default_factory=dict)


def _distinct(mask: int) -> float:
    """Linear counting: distinct keys behind a mask of ``_MASK_BITS`` bits."""
    zeros = _MASK_BITS - mask.bit_count()
    if zeros == 0:
        return _MASK_BITS * math.log(_MASK_BITS)
    return -_MASK_BITS * math.log(zeros / _MASK_BITS)


class HotKeyDetector:
    """Samples fingerprints and tells which keys are hot (see the module's docstring)."""

    def __init__(self, settings: HotKeySettings, rng: random.Random | None = None, now: float = 0.0) -> None:
        if not 0.0 < settings.sample_rate <= 1.0:
            raise ValueError("sample_rate must be in (0, 1]")
        self.settings = settings
        self._rng = rng or random.Random(0)
        self._log_miss = math.log1p(-settings.sample_rate) if settings.sample_rate < 1.0 else 0.0
        self._skip = self._gap()
        self._buckets: dict[int, _Bucket] = {}
        self._window_end = now + settings.window_s
        self._streak: dict[int, int] = {}
        self._hot: dict[int, HotKey] = {}
        self._table: dict[int, int] = {}
        self._cooling: dict[int, tuple[int, int]] = {}  # cooled keys -> (windows left, k)
        self._exemplars: dict[int, tuple[str, bytes]] = {}
        self._warmed: dict[int, set[str]] = {}  # hot key -> replicas of its set already warmed or holding it
        self.windows_closed = 0

    def _gap(self) -> int:
        """Requests to pass over before the next sample (geometric with the sample rate)."""
        if self._log_miss == 0.0:
            return 0
        u = 1.0 - self._rng.random()  # (0, 1]
        return int(math.log(u) / self._log_miss)

    def observe(self, key: str | int | None, tokens: int, now: float) -> None:
        """One request with prefix ring key ``key`` (None: it has none) and ``tokens`` prompt tokens."""
        if self._sampled(now, key is not None) and key is not None:
            self.observe_sampled(fingerprint(key), tokens)

    def observe_fingerprint(self, fp: int | None, tokens: int, now: float) -> None:
        """:meth:`observe` for a key whose fingerprint the caller has (None: it has no key)."""
        if self._sampled(now, fp is not None) and fp is not None:
            self.observe_sampled(fp, tokens)

    def _sampled(self, now: float, keyed: bool) -> bool:
        """Whether this request is one the sample counts (advancing the window first); one
        without a key (not ``keyed``) is never counted and takes no place in the sample."""
        if now >= self._window_end:
            self.advance(now)
        if not keyed:
            return False
        if self._skip > 0:
            self._skip -= 1
            return False
        self._skip = self._gap()
        return True

    def observe_sampled(self, fp: int, tokens: int) -> None:
        """Count one sampled fingerprint in the current window."""
        s = self.settings
        index = fp % s.buckets
        bucket = self._buckets.get(index)
        if bucket is None:
            bucket = self._buckets[index] = _Bucket()
        bucket.total += 1
        bucket.mask |= 1 << ((fp >> 20) % _MASK_BITS)
        entry = bucket.top.get(fp)
        if entry is None:
            if len(bucket.top) < s.per_bucket:
                entry = bucket.top[fp] = _Entry()
            else:  # space-saving: the newcomer takes the smallest entry's place and count
                smallest = min(bucket.top, key=lambda k: bucket.top[k].count)
                old = bucket.top.pop(smallest)
                entry = bucket.top[fp] = _Entry(old.count, old.count, 0)
        entry.count += 1
        entry.tokens += tokens

    def advance(self, now: float) -> None:
        """Close every window that ended by ``now`` (empty ones too: a key cools without traffic)."""
        s = self.settings
        while now >= self._window_end:
            if not self._buckets and not self._streak and not self._hot:
                # Nothing counted and nothing hot: the idle windows need no walk.
                missed = math.floor((now - self._window_end) / s.window_s) + 1
                self._window_end += missed * s.window_s
                self.windows_closed += missed
                # No traffic in those windows: what still lingers needs one replica.
                self._cooling = {fp: (n - missed, 1) for fp, (n, _) in self._cooling.items() if n > missed}
                self._table = {fp: k for fp, (_, k) in self._cooling.items()}
                break
            self._close(self._window_end)
            self._window_end += s.window_s

    def _close(self, end: float) -> None:
        s = self.settings
        self.windows_closed += 1
        buckets, self._buckets = self._buckets, {}
        total = sum(b.total for b in buckets.values())
        distinct = sum(_distinct(b.mask) for b in buckets.values())
        above: dict[int, tuple[float, float]] = {}
        for b in buckets.values():
            d_b = _distinct(b.mask)
            for fp, e in b.top.items():
                sure = e.count - e.error
                if sure < s.min_samples:
                    continue
                if d_b - 1 >= _MIN_PEERS:
                    baseline = (b.total - e.count) / (d_b - 1)
                else:
                    baseline = (total - e.count) / (distinct - 1) if distinct > 1.5 else 0.0
                if baseline > 0 and sure >= s.threshold * baseline:
                    rate = e.count / s.sample_rate / s.window_s
                    above[fp] = (rate, e.tokens / e.count)
        streak: dict[int, int] = {}
        # Keys not hot: a streak of windows above the bar turns them hot.
        for fp, (rate, tokens) in above.items():
            if fp in self._hot:
                continue
            n = self._streak.get(fp, 0) + 1
            if n >= s.windows:
                self._hot[fp] = HotKey(fp, rate, tokens, self._replicas(rate, tokens), end)
            else:
                streak[fp] = n
        # Hot keys: a streak of windows below the bar cools them; above it, their figures refresh.
        for fp, hot in list(self._hot.items()):
            if fp in above:
                rate, tokens = above[fp]
                self._hot[fp] = HotKey(fp, rate, tokens, self._replicas(rate, tokens), hot.since)
            else:
                n = self._streak.get(fp, 0) + 1
                if n >= s.windows:
                    del self._hot[fp]
                    if s.linger_windows:
                        self._cooling[fp] = (s.linger_windows + 1, 1)  # this window's decrement below
                else:
                    streak[fp] = n
        if len(self._hot) > s.max_hot:
            keep = sorted(self._hot.values(), key=lambda h: -h.rate_rps)[: s.max_hot]
            self._hot = {h.fingerprint: h for h in keep}
        self._streak = streak
        # A cooled key's k follows its own rate in the window (one replica once its traffic is
        # gone): a key that cooled only because others grew keeps the replicas its load needs.
        seen = {fp: e for b in buckets.values() for fp, e in b.top.items() if fp in self._cooling}
        cooling = {}
        for fp, (n, _) in self._cooling.items():
            if n > 1 and fp not in self._hot:
                now_seen = seen.get(fp)
                k = 1
                if now_seen is not None:
                    k = self._replicas(now_seen.count / s.sample_rate / s.window_s, now_seen.tokens / now_seen.count)
                cooling[fp] = (n - 1, k)
        if len(cooling) > s.max_hot:
            cooling = dict(sorted(cooling.items(), key=lambda kv: -kv[1][0])[: s.max_hot])
        self._cooling = cooling
        self._table = {**{fp: k for fp, (_, k) in cooling.items()}, **{fp: h.replicas for fp, h in self._hot.items()}}
        for fp in [fp for fp in self._exemplars if fp not in self._hot]:
            del self._exemplars[fp]
        for fp in [fp for fp in self._warmed if fp not in self._hot]:
            del self._warmed[fp]

    def _replicas(self, rate: float, tokens: float) -> int:
        """Replicas a key gets: its prefill demand over one replica's capacity, within the bound."""
        s = self.settings
        want = math.ceil(rate * tokens / s.replica_prefill_tokens_per_s) if s.replica_prefill_tokens_per_s else 1
        return max(1, min(s.max_replicas, want))

    def table(self) -> Mapping[int, int]:
        """Hot fingerprints and how many replicas each should have (cooling ones: 1): what the
        decision is given."""
        return self._table

    def wants_exemplar(self, fp: int) -> bool:
        """Whether a request body of hot key ``fp`` should be kept to warm replicas with (one per
        hot key, only while it is hot: at most ``max_hot`` bodies of ``warm_max_bytes``)."""
        return self.settings.warm_on_join and fp in self._hot and fp not in self._exemplars

    def keep_exemplar(self, fp: int, path: str, body: bytes) -> None:
        """Keep one request of hot key ``fp`` (its path and body) to warm replicas with."""
        if self.wants_exemplar(fp) and len(body) <= self.settings.warm_max_bytes:
            self._exemplars[fp] = (path, body)

    def warm_set(self) -> list[tuple[str, bytes]]:
        """The bodies to warm a new replica with: the top ``warm_top`` hot keys by rate that have one."""
        ranked = sorted(self._hot.values(), key=lambda h: -h.rate_rps)
        out = [self._exemplars[h.fingerprint] for h in ranked if h.fingerprint in self._exemplars]
        return out[: self.settings.warm_top]

    def exemplar(self, fp: int) -> tuple[str, bytes] | None:
        """The request (path, body) kept of hot key ``fp``, if any."""
        return self._exemplars.get(fp)

    def newcomers(self, fp: int, members: Sequence[str], holding: Container[str]) -> list[str]:
        """The members of hot key ``fp``'s replica set to warm: those that neither hold it
        (``holding``) nor were warmed or seen holding it before, each named once while the key
        stays hot; none while no request of it is kept to warm them with."""
        if fp not in self._exemplars or not self.settings.warm_on_join:
            return []
        seen = self._warmed.setdefault(fp, set())
        fresh = [m for m in members if m not in seen and m not in holding]
        seen.update(members)
        return fresh

    def warm_ready(self, fp: int) -> bool:
        """Whether a request of hot key ``fp`` is kept to warm joining replicas with."""
        return fp in self._exemplars

    @property
    def cooling(self) -> int:
        """Keys that cooled and keep one replica for a while."""
        return len(self._cooling)

    def hot(self) -> Mapping[int, HotKey]:
        """The hot keys by fingerprint (read-only use: it changes as windows close)."""
        return self._hot
