"""The disaggregated fleet on the virtual clock (extproc_lab.sim.disagg)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from extproc.api import PairSettings, Role
from extproc_lab.replica.timing import get_profile
from extproc_lab.sim.disagg import DisaggSimulation, FleetView, Route, fleet, ours, peer
from extproc_lab.sim.generators import multi_turn

PROFILE = get_profile("llama-8b-h100")
CHAT = multi_turn(30, seed=3)
ALWAYS = PairSettings(threshold_tokens=0, decode_interference=100.0)


def test_every_request_finishes_and_a_hop_lands_its_blocks_as_cached() -> None:
    run = DisaggSimulation(CHAT, PROFILE, fleet(1, 2), peer("round_robin")).run()
    assert len(run.outcomes) == len(CHAT)
    assert all(o.prefill == 0 and o.decode in (1, 2) for o in run.outcomes)
    # What crossed is cached on the decode replica: at least the transferred blocks' tokens.
    assert all(o.decode_cached_tokens >= 16 * o.transfer_blocks for o in run.outcomes)
    assert sum(o.transfer_blocks for o in run.outcomes) > 0
    # The prefill replica computed the prompts; the decode replicas only what did not cross.
    assert run.prefill_tokens[0] > run.prefill_tokens[1] + run.prefill_tokens[2]
    assert all(o.first_token > o.arrival and o.finish >= o.first_token for o in run.outcomes)


def test_runs_are_deterministic() -> None:
    first = DisaggSimulation(CHAT, PROFILE, fleet(1, 2), ours()).run()
    again = DisaggSimulation(CHAT, PROFILE, fleet(1, 2), ours()).run()
    assert first.outcomes == again.outcomes


def test_no_hop_on_an_aggregated_fleet_and_sessions_stay_on_their_decode_replica() -> None:
    run = DisaggSimulation(CHAT, PROFILE, fleet(0, 0, 3), ours(PairSettings(threshold_tokens=1 << 40))).run()
    assert all(o.prefill is None and o.transfer_blocks == 0 for o in run.outcomes)
    where: dict[str, set[int]] = {}
    for o in run.outcomes:
        where.setdefault(CHAT.requests[o.index].session or "", set()).add(o.decode)
    assert all(len(replicas) == 1 for replicas in where.values())


def test_a_dearer_transfer_delays_the_first_token() -> None:
    cheap = DisaggSimulation(CHAT, PROFILE, fleet(1, 2), ours(ALWAYS)).run()
    dear = DisaggSimulation(CHAT, replace(PROFILE, kv_transfer_s_per_block=0.01), fleet(1, 2), ours(ALWAYS)).run()
    assert sum(o.ttft for o in dear.outcomes) > sum(o.ttft for o in cheap.outcomes)
    assert any(o.prefill is not None for o in cheap.outcomes)


def test_a_follow_up_turn_transfers_only_what_its_decode_replica_lacks() -> None:
    run = DisaggSimulation(CHAT, PROFILE, fleet(1, 2), ours(ALWAYS)).run()
    by_index = {o.index: o for o in run.outcomes}
    follow_ups = [by_index[r.index] for r in CHAT.requests if r.after >= 0 and by_index[r.index].prefill is not None]
    assert follow_ups
    assert all(o.transfer_blocks < o.prompt_tokens // 16 for o in follow_ups)


def test_a_policy_breaking_roles_is_refused() -> None:
    def wrong(view: FleetView) -> Route:
        return Route(decode=0)  # the prefill replica

    with pytest.raises(RuntimeError, match="another role"):
        DisaggSimulation(CHAT, PROFILE, fleet(1, 1), wrong).run()
    with pytest.raises(ValueError):
        DisaggSimulation(CHAT, PROFILE, [Role.PREFILL], wrong)


def test_ours_is_the_decision_the_server_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from extproc.api import DecisionInputs, decide
    from extproc_lab.sim import disagg

    calls: list[str | None] = []

    def counted(given: DecisionInputs, trace: object = None) -> object:
        decision = decide(given)
        calls.append(decision.prefill.name if decision.prefill is not None else None)
        return decision

    monkeypatch.setattr(disagg, "decide", counted)
    run = DisaggSimulation(CHAT, PROFILE, fleet(1, 2), ours(ALWAYS)).run()
    # One decision per request, and the route is the decision's: its prefill hop where it made one.
    assert len(calls) == len(CHAT)
    assert sum(c is not None for c in calls) == sum(o.prefill is not None for o in run.outcomes) > 0
