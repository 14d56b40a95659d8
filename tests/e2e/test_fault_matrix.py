"""The fault matrix through real Envoy, at small scale: each fault injected under load into a
gateway of its own, with bounded durations, and what the clients saw asserted.

The cases live in :mod:`extproc_lab.demo.fault_matrix`; ``benchmarks/fault_matrix.py`` runs them
bigger and writes ``benchmarks/fault_matrix.md``. Two faults of the matrix are asserted elsewhere
and not repeated here: a replica killed mid-replay (``tests/e2e/test_failover_e2e.py``: no client
error, sessions re-pinned and sticky again, readmission, in both modes) and Redis killed under
two processors (``tests/e2e/test_shared_store_e2e.py``); the Redis case here adds a hung Redis and
the time to recover, and the killed-replica case here is the one the replay cannot show: streams
already flowing from it.
"""

from __future__ import annotations

import pytest

from extproc.adapters.envoy_config import GatewaySpec, render
from extproc.fleet.health.vllm_metrics import parse_vllm_metrics
from extproc.routing import Replica
from extproc_lab.demo import fault_matrix as fm
from extproc_lab.demo.faulty import ABSURD_PAGE, NEGATIVE_PAGE
from tests.conftest import require_binary
from tests.helpers import PRICE_CONFIG, assert_every_shape_answered_within_its_budget

pytestmark = pytest.mark.e2e
SMALL = fm.SMALL


@pytest.fixture(autouse=True)
def _envoy() -> None:
    require_binary("envoy")


async def test_processor_killed_under_load_fails_open_then_routing_resumes() -> None:
    row = await fm.processor_restart(SMALL)
    facts = row.facts
    assert row.lost == 0, row
    assert facts["fail_open_requests"] > 0  # the load really ran while it was down
    assert facts["replica_changes_during"] > 0  # Envoy's round robin: sessions scattered
    assert row.recover_s is not None and row.recover_s < 5.0, row
    assert facts["sessions_after"] > 0 and facts["replica_changes_after"] == 0, facts  # sticky again


async def test_redis_hung_then_killed_costs_no_request_and_recovers() -> None:
    require_binary("redis-server")
    hung, killed = await fm.redis_outage(SMALL)
    for row in (hung, killed):
        assert row.requests > 0 and row.lost == 0, row
        assert row.facts["noticed_s"] is not None, row  # the outage was seen, not slept through
        assert row.recover_s is not None and row.recover_s < 5.0, row
        assert row.facts["replica_changes"] == 0, row  # routed from the local mirror meanwhile
    assert killed.facts["pins_in_redis_after"] > 0  # the restarted, empty Redis is written again


async def test_streams_cut_by_a_killed_replica_end_with_an_error_and_nothing_else_is_lost() -> None:
    row = await fm.streams_on_a_killed_replica(SMALL)
    facts = row.facts
    assert facts["streams_on_victim"] >= 1, row
    # Only the streams already flowing from it are lost: they end (Envoy closes the connection
    # after its 1 s delayed-close timeout), with an error the client library raises, not a hang.
    assert row.lost == facts["streams_on_victim"], row
    assert facts["cut_errors"] == ["ClientPayloadError"], row
    assert all(0 <= s < 3.0 for s in facts["cut_ended_after_kill_s"]), row
    assert facts["others_finished"] == facts["others"], row
    assert facts["next_turns_ok"] == SMALL.streams, row  # every session's next turn went elsewhere


def test_every_request_in_flight_to_a_dead_replica_may_be_retried() -> None:
    # Envoy's default retry circuit breaker (3 concurrent retries per cluster) made the fourth and
    # later requests in flight to a killed replica fail with a 503 in the full-size matrix; the
    # replay of tests/e2e/test_failover_e2e.py never has that many in flight at once.
    replicas = [Replica(f"r{i}", f"127.0.0.1:{8000 + i}") for i in range(3)]
    for mode in ("cluster", "endpoint"):
        clusters = render(GatewaySpec(replicas=replicas, mode=mode))["static_resources"]["clusters"]
        retried = [c for c in clusters if c["name"] not in ("extproc",)]
        assert retried and all(c["circuit_breakers"]["thresholds"][0]["max_retries"] >= 1024 for c in retried)


async def test_a_hung_replica_loses_only_the_streams_it_had_started() -> None:
    row = await fm.replica_hung(SMALL)
    facts = row.facts
    # Nothing that had not started streaming is lost: the tries on it met the first-byte timeout
    # and Envoy retried them elsewhere, within that timeout plus the retry (and a loaded machine).
    assert facts["unary_lost"] == 0, row
    assert facts["retried"] >= 1, row
    assert SMALL.first_byte_s * 0.9 <= facts["retried_max_s"] < SMALL.first_byte_s + 2.5, row
    # The streams flowing from it end with an error at its idle timeout, not at the route timeout.
    assert facts["streams_cut"] == facts["streams"] == SMALL.hung_streams == row.lost, row
    assert all(t < SMALL.stream_idle_s + 2.5 for t in facts["streams_cut_after_s"]), row
    assert row.recover_s is not None and row.recover_s < 3.0, row  # failed tries and scrapes eject it
    assert facts["readmit_s"] is not None, row  # and it comes back once it answers again


async def test_a_hung_replica_costs_every_request_shape_only_its_budget() -> None:
    # The user's check, small: the rendered failover scenario (Envoy's health checks on), the
    # sessions of one replica, then it hangs and requests of every shape follow. Non-streaming ones
    # without max_tokens (or with a huge one) waited for the route timeout before their budget
    # had a cap, and Envoy's health check marking the host failed did not end them.
    row = await fm.replica_hung_every_shape(SMALL)
    assert row.facts["health_check_path"] == "/health" and row.facts["mode"] == "cluster"
    assert_every_shape_answered_within_its_budget(row, SMALL)
    # The price (opt-in) sends a session away once the unanswered queue on the hung replica costs
    # more than its short history: only the upper bound holds for every request there.
    priced = await fm.replica_hung_every_shape(SMALL, profile=PRICE_CONFIG.read_text())
    assert_every_shape_answered_within_its_budget(priced, SMALL, tried_first=False)


async def test_broken_metrics_pages_cost_no_request() -> None:
    rows = {row.case.split()[-1]: row for row in await fm.metrics_faults(SMALL)}
    assert set(rows) == {"negative", "hang", "garbage", "absurd"}
    for row in rows.values():
        assert row.requests > 0 and row.lost == 0, row
        assert row.facts["readmit_s"] is not None, row  # back once the page heals
    # Every scrape fails on a garbage page: out of rotation within about a second.
    assert rows["garbage"].recover_s is not None and rows["garbage"].recover_s < 2.5, rows["garbage"]
    assert rows["garbage"].facts["served_while_out"] == 0, rows["garbage"]
    # A page that never comes while the replica keeps answering requests is a busy replica's (a CPU
    # vLLM engine prefilling answers /metrics late), not a dead one's: it stays in rotation, and
    # its aged load figures do not draw new sessions to it.
    assert rows["hang"].recover_s is None, rows["hang"]
    assert rows["hang"].facts["new_session_share"] <= 0.6, rows["hang"]
    # Impossible load keeps it out of the way without an ejection; negative counts are not read
    # as "emptier than idle" (that drew every new session to it before they were clamped).
    assert rows["absurd"].facts["new_session_share"] == 0.0, rows["absurd"]
    assert rows["negative"].facts["new_session_share"] <= 0.6, rows["negative"]


def test_impossible_gauges_are_clamped() -> None:
    negative = parse_vllm_metrics(NEGATIVE_PAGE)
    assert (negative.running, negative.waiting, negative.kv_usage) == (0, 0, 0.0)
    absurd = parse_vllm_metrics(ABSURD_PAGE)
    assert absurd.kv_usage == 1.0 and absurd.waiting == 10**12


async def test_eight_megabyte_bodies_are_routed_and_answered() -> None:
    row = await fm.big_bodies(SMALL)
    facts = row.facts
    assert row.lost == 0, row
    assert facts["body_errors"] == 0  # parsed, not routed blind
    assert facts["decided"] == facts["sent_through_processor"], facts  # none fell open on a timeout
    assert len(facts["big_replicas"]) == 1, facts  # every turn of the session on one replica


async def test_thousands_of_sessions_keep_the_session_map_within_its_bound() -> None:
    row = await fm.many_sessions(SMALL)
    facts = row.facts
    assert row.lost == 0, row
    assert facts["sessions_peak"] <= SMALL.session_bound, facts
    assert facts["sessions_held"] == SMALL.session_bound, facts  # full, and no more
    assert facts["revisits_moved"] == 0, facts  # the recent sessions the LRU kept stay put


async def test_a_burst_of_new_sessions_spreads() -> None:
    row = await fm.session_burst(SMALL)
    assert row.lost == 0, row
    assert row.facts["max_over_share"] <= 1.5, row


async def test_a_burst_of_new_sessions_sharing_a_system_prompt_spreads() -> None:
    # The prefill-cost scorer weighs the shared prefix against the queue behind it (this was a
    # strict xfail while a prefix match alone outweighed load).
    row = await fm.session_burst(SMALL, shared_system_prompt=True)
    assert row.lost == 0, row
    assert row.facts["max_over_share"] <= 1.5, row
