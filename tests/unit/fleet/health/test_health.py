"""Replica health: vLLM metrics parsing, the score, the rotation state machine, the scraper."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.fleet.health import (
    HealthLimits,
    HealthSettings,
    HealthSignals,
    HealthWeights,
    MetricsPageError,
    Rotation,
    RotationPolicy,
    health_score,
    parse_vllm_metrics,
    step,
)
from extproc.fleet.health.replicas import ReplicaBook
from extproc.fleet.health.scraper import ScrapeError, Scraper
from extproc.fleet.health.vllm_metrics import bucket_delta, histogram_quantile
from extproc.routing import Replica
from tests.conftest import ROOT

SAMPLE_PATH = ROOT / "tests" / "data" / "vllm_metrics_sample.txt"


def page(running: int = 0, waiting: int = 0, kv: float = 0.0, legacy: bool = False) -> str:
    kv_name = "vllm:gpu_cache_usage_perc" if legacy else "vllm:kv_cache_usage_perc"
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
        f"# TYPE {kv_name} gauge\n"
        f'{kv_name}{{engine="0",model_name="m"}} {kv}\n'
    )


def test_parses_the_shared_vllm_sample() -> None:
    m = parse_vllm_metrics(SAMPLE_PATH.read_text())
    assert (m.running, m.waiting, m.block_size, m.num_gpu_blocks) == (14, 3, 16, 27545)
    assert 0.0 < m.kv_usage < 1.0 and m.prefix_hits <= m.prefix_queries
    assert m.lora is not None and m.lora.max_lora == 4 and m.lora.waiting == ("chat-lora",)  # newest series
    assert m.ttft_buckets[-1][0] == float("inf")


def test_older_gpu_cache_usage_name_is_read() -> None:
    assert parse_vllm_metrics(page(1, 2, 0.5, legacy=True)).kv_usage == 0.5


@pytest.mark.parametrize("text", ["", "garbage {{{", "# TYPE x gauge\nx 1\n", "<html>503</html>"])
def test_unusable_pages_raise(text: str) -> None:
    with pytest.raises(MetricsPageError):
        parse_vllm_metrics(text)


def test_histogram_quantile_and_delta() -> None:
    old = ((0.1, 10.0), (1.0, 10.0), (float("inf"), 10.0))
    new = ((0.1, 10.0), (1.0, 60.0), (float("inf"), 110.0))
    delta = bucket_delta(new, old)
    assert delta == ((0.1, 0.0), (1.0, 50.0), (float("inf"), 100.0))
    assert histogram_quantile(delta, 0.99) == 1.0  # beyond the last finite bucket: its bound
    assert histogram_quantile(((1.0, 5.0),), 0.99) is None  # too few samples
    assert bucket_delta(old, new) == old  # a counter reset: everything is new


@given(
    st.integers(0, 500), st.floats(0, 1), st.one_of(st.none(), st.floats(0, 100)), st.floats(0, 1), st.integers(0, 5)
)
def test_score_is_in_unit_interval(queue: int, kv: float, ttft: float | None, errors: float, failures: int) -> None:
    s = health_score(HealthSignals(queue, kv, ttft, errors, failures), HealthWeights(), HealthLimits())
    assert 0.0 <= s <= 1.0
    if failures >= HealthLimits().unreachable_after:
        assert s == 0.0


def test_idle_replica_is_fully_healthy_and_a_drowning_one_is_not() -> None:
    assert health_score(HealthSignals(), HealthWeights(), HealthLimits()) == 1.0
    bad = HealthSignals(queue=200, kv_usage=1.0, ttft_p99_s=10.0, error_rate=0.0)
    assert health_score(bad, HealthWeights(), HealthLimits()) < 0.5


def test_a_fleet_busy_as_a_whole_ejects_nobody_but_an_outlier_is_still_ejected() -> None:
    # Every replica as loaded as the next: the fleet is overloaded, and ejecting any of them would
    # pile its share onto the rest. One far worse than its peers is still taken out.
    names = [f"r{i}" for i in range(6)]
    book = ReplicaBook([Replica(n, f"h:{i}") for i, n in enumerate(names)], HealthSettings())
    drowning = parse_vllm_metrics(page(8, 60, 0.99))

    def run(start: int, slow: set[str]) -> None:
        for t in range(start, start + 5):
            for n in names:
                book.apply_scrape(n, drowning if n in slow else parse_vllm_metrics(page(1, 0, 0.2)), now=float(t))
                for _ in range(12):  # first bytes Envoy saw: 30 s behind the queue, or quick
                    book.observe(n, 200, 30.0 if n in slow else 0.3, float(t))
            book.evaluate(float(t))

    run(0, set(names))
    assert all(r.rotation.in_rotation for r in book.records())
    alone = HealthSignals(queue=60, kv_usage=0.99, ttft_p99_s=30.0)
    assert health_score(alone, HealthWeights(), HealthLimits()) < 0.5  # judged alone, each would be ejected
    run(100, {"r0"})  # a minute later: the first bytes of the busy spell are out of the window
    assert [r.replica.name for r in book.records() if not r.rotation.in_rotation] == ["r0"]


@given(st.lists(st.floats(0, 1), min_size=1, max_size=200), st.floats(0.05, 2.0))
def test_rotation_never_flaps(scores: list[float], interval: float) -> None:
    policy = RotationPolicy()
    state = Rotation()
    changes: list[tuple[float, bool]] = []
    for i, score in enumerate(scores):
        now = i * interval
        new = step(state, score, now, policy)
        if new.in_rotation != state.in_rotation:
            changes.append((now, new.in_rotation))
        state = new
    for (t0, in0), (t1, _) in itertools.pairwise(changes):
        if not in0:  # ejected at t0: back no sooner than the cooldown
            assert t1 - t0 >= policy.cooldown_s


def test_oscillating_signal_never_ejects() -> None:
    policy = RotationPolicy()
    state = Rotation()
    for i in range(1000):
        state = step(state, 0.1 if i % 2 else 0.9, i * 0.25, policy)
        assert state.in_rotation


def test_hard_failure_ejects_at_once_and_cooldown_holds() -> None:
    policy = RotationPolicy(cooldown_s=5)
    state = step(Rotation(), 1.0, 0.0, policy, hard_failure=True)
    assert not state.in_rotation
    for t in (1.0, 2.0, 4.9):
        state = step(state, 1.0, t, policy)
        assert not state.in_rotation
    state = step(step(state, 1.0, 5.0, policy), 1.0, 5.25, policy)
    assert state.in_rotation


def test_one_slow_request_does_not_eject() -> None:
    book = ReplicaBook([Replica("a", "h:1")])
    book.observe("a", 200, 30.0, now=0.0)  # one very slow first byte
    for i in range(10):
        book.evaluate(i * 0.25)
    assert book.snapshot(3.0).replicas[0].in_rotation


def test_stale_scraped_load_is_not_trusted() -> None:
    book = ReplicaBook([Replica("a", "h:1")], HealthSettings(stale_after_s=2.0))
    book.apply_scrape("a", parse_vllm_metrics(page(4, 40, 0.97)), now=0.0)
    assert book.snapshot(1.0).replicas[0].kv_usage == 0.97
    assert book.snapshot(3.0).replicas[0].kv_usage == 0.0 and book.snapshot(3.0).replicas[0].queue == 0


class FakeFetch:
    """Serves pages per URL; a page may be an exception to raise."""

    def __init__(self) -> None:
        self.pages: dict[str, str | Exception] = {}
        self.calls: list[str] = []

    async def __call__(self, url: str, timeout_s: float) -> str:
        self.calls.append(url)
        page_ = self.pages.get(url, ScrapeError("no page"))
        if isinstance(page_, Exception):
            raise page_
        return page_


async def test_scraper_ejects_a_refusing_replica_in_one_round_and_readmits_it() -> None:
    clock = [0.0]
    book = ReplicaBook([Replica("a", "h:1"), Replica("b", "h:2")])
    fetch = FakeFetch()
    fetch.pages["http://h:1/metrics"] = page(1, 0, 0.2)
    fetch.pages["http://h:2/metrics"] = ScrapeError("refused", refused=True)
    scraper = Scraper(book, HealthSettings(), lambda: clock[0], fetch=fetch)
    transitions = await scraper.scrape_once()
    assert [(t.replica, t.in_rotation) for t in transitions] == [("b", False)]
    fetch.pages["http://h:2/metrics"] = page(0, 0, 0.1)
    for _ in range(3):
        clock[0] += 11.0  # past the cooldown
        await scraper.scrape_once()
    assert all(s.in_rotation for s in book.snapshot(clock[0]).replicas)


async def test_scraper_tolerates_timeouts_and_garbage_for_a_while() -> None:
    clock = [0.0]
    book = ReplicaBook([Replica("a", "h:1")])
    fetch = FakeFetch()
    fetch.pages["http://h:1/metrics"] = "<html>oops</html>"
    scraper = Scraper(book, HealthSettings(), lambda: clock[0], fetch=fetch)
    await scraper.scrape_once()
    await scraper.scrape_once()
    assert book.snapshot(0.0).replicas[0].in_rotation  # two bad pages: not yet
    for _ in range(3):
        await scraper.scrape_once()
    assert not book.snapshot(0.0).replicas[0].in_rotation  # a replica that never answers leaves


async def test_scraper_reads_a_real_fake_replica() -> None:
    import asyncio

    from extproc_lab.demo.processes import free_port
    from extproc_lab.replica import serve_replica

    port = free_port()
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve_replica("r", "127.0.0.1", port, "demo", "demo-model", 0.02, ready))
    await ready
    try:
        book = ReplicaBook([Replica("r", f"127.0.0.1:{port}")])
        # What is read, not how fast: a first connection on a busy host outlasted the 0.2 s default.
        scraper = Scraper(book, HealthSettings(scrape_timeout_s=5), asyncio.get_running_loop().time)
        await scraper.scrape_once()
        rec = book.records()[0]
        assert rec.metrics is not None and rec.metrics.num_gpu_blocks is not None and rec.scrape_failures == 0
        dead = ReplicaBook([Replica("x", f"127.0.0.1:{free_port()}")])
        dead_scraper = Scraper(dead, HealthSettings(), asyncio.get_running_loop().time)
        await dead_scraper.scrape_once()
        assert dead.records()[0].refused and not dead.records()[0].rotation.in_rotation
        for s in (scraper, dead_scraper):
            await s.fetch.close()  # type: ignore[attr-defined]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_a_replica_ejected_for_failures_is_readmitted_on_what_it_shows_afterwards() -> None:
    # Out of rotation it gets no traffic, so what traffic showed of it could never improve: the
    # slow answers and failures that ejected it must not keep it out once it answers well again
    # (the TTFT window is a minute, and the error rate only moves with new responses).
    book = ReplicaBook([Replica("a", "h:1")], HealthSettings(cooldown_s=1.0))
    for i in range(30):  # it slowed down (first bytes after 5 s, twice the TTFT SLO)...
        book.observe("a", 200, 5.0, now=0.001 * i)
    for i in range(12):  # ...then its tries met the first-byte timeout, enough to eject it
        book.observe("a", 0, None, now=0.1 + 0.01 * i)
    assert not book.snapshot(0.2).replicas[0].in_rotation
    for i in range(4):
        book.apply_scrape("a", parse_vllm_metrics(page()), now=2.0 + i * 0.25)
        book.evaluate(2.0 + i * 0.25)
    assert book.snapshot(3.0).replicas[0].in_rotation
    for i in range(3):  # and failing again puts it straight back out
        book.observe("a", 0, None, now=3.1 + 0.01 * i)
    assert not book.snapshot(3.2).replicas[0].in_rotation


async def test_a_late_page_from_a_replica_that_keeps_answering_is_no_failure() -> None:
    # A CPU engine busy prefilling answers /metrics after the scrape budget; Envoy still sees it
    # answer requests. That is a busy replica, not an unreachable one (on real vLLM one of three
    # engines was ejected this way under load). One that stops answering as well does leave.
    clock = [0.0]
    book = ReplicaBook([Replica("a", "h:1"), Replica("b", "h:2")])
    fetch = FakeFetch()
    fetch.pages["http://h:1/metrics"] = ScrapeError("late", timed_out=True)
    fetch.pages["http://h:2/metrics"] = page(0, 0, 0.1)
    scraper = Scraper(book, HealthSettings(), lambda: clock[0], fetch=fetch)
    for _ in range(6):
        clock[0] += 0.25
        book.observe("a", 200, 0.5, clock[0])
        await scraper.scrape_once()
    assert all(s.in_rotation for s in book.snapshot(clock[0]).replicas)
    # No new answer for longer than stale_after_s, but long prefills still running there: busy.
    book.begin("a", clock[0], prefill_tokens=4000)
    for _ in range(12):
        clock[0] += 0.25
        await scraper.scrape_once()
    assert all(s.in_rotation for s in book.snapshot(clock[0]).replicas)
    book.end("a", clock[0], prefill_tokens=4000, kv_tokens=0)
    for _ in range(12):  # nothing running and nothing answered: after stale_after_s its late pages count
        clock[0] += 0.25
        await scraper.scrape_once()
    assert [s.name for s in book.snapshot(clock[0]).replicas if not s.in_rotation] == ["a"]
