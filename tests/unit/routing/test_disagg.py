"""Roles from labels, and the prefill hop for a chosen decode replica (extproc.routing.disagg); the
decode replica is the pipeline's choice (tests/unit/routing/test_disagg_decision.py)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.routing.disagg import Pair, PairInputs, PairReason, PairSettings, choose_prefill, local_cost, prefill_cost
from extproc.routing.model import Replica, ReplicaState
from extproc.routing.roles import ROLE_LABEL, Role, role_of


def state(name: str, role: str | None = None, **load: float) -> ReplicaState:
    labels = {ROLE_LABEL: role} if role is not None else {}
    return ReplicaState(Replica(name, f"{name}:8000", labels=labels), **load)  # type: ignore[arg-type]


def pair_for(inputs: PairInputs, settings: PairSettings | None = None, decode: str | None = None) -> Pair:
    """The hop for ``decode`` (default: the pin, else the first replica that decodes)."""
    decoders = [s for s in inputs.candidates if s.role.decodes]
    if not decoders:
        return Pair(None, None, PairReason.NO_DECODER)
    name = decode or inputs.pinned
    chosen = next((s for s in decoders if s.name == name), decoders[0])
    return choose_prefill(inputs, chosen, settings)


def test_role_of_labels() -> None:
    assert role_of({ROLE_LABEL: "prefill"}) is Role.PREFILL
    assert role_of({ROLE_LABEL: "Decode"}) is Role.DECODE
    assert role_of({ROLE_LABEL: "both"}) is Role.BOTH
    assert role_of({ROLE_LABEL: "prefill-decode"}) is Role.BOTH
    assert role_of({}) is Role.BOTH
    assert role_of({ROLE_LABEL: "encode"}) is Role.BOTH
    assert state("p", "prefill").role is Role.PREFILL
    assert Role.PREFILL.prefills and not Role.PREFILL.decodes
    assert Role.DECODE.decodes and not Role.DECODE.prefills
    assert Role.BOTH.prefills and Role.BOTH.decodes


# Decode replicas busy decoding: a long prefill there would stall their batches.
FLEET = (
    state("p0", "prefill"),
    state("p1", "prefill"),
    state("d0", "decode", running=20),
    state("d1", "decode", running=20),
)


def test_a_long_new_prompt_is_disaggregated_to_the_least_backlogged_prefiller() -> None:
    fleet = (state("p0", "prefill", pending_prefill_tokens=9000), *FLEET[1:])
    pair = pair_for(PairInputs(fleet, 4000))
    assert pair.reason is PairReason.DISAGGREGATED
    assert pair.prefill is not None and pair.prefill.name == "p1"
    assert pair.decode is not None and pair.decode.role is Role.DECODE
    assert pair.new_tokens == 4000 and pair.transfer_blocks == 250


def test_the_prefiller_holding_the_prompt_wins_over_an_idle_one() -> None:
    pair = pair_for(PairInputs(FLEET, 4000, {"p1": 3200}))
    assert pair.prefill is not None and pair.prefill.name == "p1"


def test_a_short_prompt_runs_aggregated_on_the_decode_replica() -> None:
    pair = pair_for(PairInputs(FLEET, 200))
    assert pair.prefill is None and pair.reason is PairReason.SHORT


def test_a_decode_replica_holding_the_conversation_needs_no_hop_or_only_the_new_blocks() -> None:
    held = pair_for(PairInputs(FLEET, 6000, {"d1": 5800}, pinned="d1"))
    assert held.decode is not None and held.decode.name == "d1" and held.sticky
    assert held.prefill is None and held.reason is PairReason.HELD and held.new_tokens == 200
    # A prefill replica holding the earlier turns computes only the new ones: only those cross.
    more = pair_for(PairInputs(FLEET, 6000, {"d1": 4000, "p0": 4000}, pinned="d1"))
    assert more.reason is PairReason.DISAGGREGATED and more.transfer_blocks == (6000 - 4000) // 16
    # One that does not would compute all 6,000 where the decode replica lacks 2,000.
    local = pair_for(PairInputs(FLEET, 6000, {"d1": 4000}, pinned="d1"))
    assert local.prefill is None and local.reason is PairReason.LOCAL


def test_an_idle_decode_replica_computes_what_it_lacks_itself() -> None:
    fleet = (FLEET[0], state("d0", "decode"))
    assert pair_for(PairInputs(fleet, 4000)).reason is PairReason.LOCAL
    busy = (FLEET[0], state("d0", "decode", running=5))
    assert pair_for(PairInputs(busy, 4000)).reason is PairReason.DISAGGREGATED
    stalled = PairSettings(decode_interference=0.0)
    assert pair_for(PairInputs(busy, 4000), stalled).reason is PairReason.LOCAL


def test_without_a_prefiller_or_decoder() -> None:
    decode_only = pair_for(PairInputs(FLEET[2:], 4000))
    assert decode_only.prefill is None and decode_only.reason is PairReason.NO_PREFILLER
    assert pair_for(PairInputs(FLEET[:2], 4000)) == Pair(None, None, PairReason.NO_DECODER)


def test_a_both_replica_keeps_a_prompt_no_other_would_finish_sooner() -> None:
    fleet = (state("p0", "prefill", pending_prefill_tokens=20_000), state("b0", "both"))
    pair = pair_for(PairInputs(fleet, 4000))
    assert pair.decode.name == "b0" and pair.reason is PairReason.LOCAL  # type: ignore[union-attr]


ROLES = st.sampled_from(["prefill", "decode", "both", None])


@st.composite
def inputs(draw: st.DrawFn) -> tuple[PairInputs, PairSettings]:
    n = draw(st.integers(1, 7))
    prompt = draw(st.integers(0, 20_000))
    fleet = []
    cached = {}
    for i in range(n):
        name = f"r{i}"
        fleet.append(
            state(
                name,
                draw(ROLES),
                running=draw(st.integers(0, 60)),
                queue=draw(st.integers(0, 20)),
                kv_usage=draw(st.floats(0.0, 1.0)),
                pending_prefill_tokens=draw(st.integers(0, 50_000)),
            )
        )
        if draw(st.booleans()):
            cached[name] = draw(st.integers(0, prompt))
    pinned = draw(st.sampled_from([None, *(s.name for s in fleet)]))
    threshold = draw(st.integers(0, 4096))
    return PairInputs(tuple(fleet), prompt, cached, pinned), PairSettings(threshold_tokens=threshold)


@given(inputs(), st.randoms(use_true_random=False))
@settings(max_examples=300, deadline=None)
def test_pair_invariants(case: tuple[PairInputs, PairSettings], rnd: random.Random) -> None:
    inp, cfg = case
    pair = pair_for(inp, cfg)
    if not any(s.role.decodes for s in inp.candidates):
        assert pair.decode is None and pair.prefill is None
        return
    assert pair.decode is not None and pair.decode.role.decodes
    held = min(inp.prompt_tokens, inp.cached_tokens.get(pair.decode.name, 0))
    assert pair.new_tokens == inp.prompt_tokens - held
    if pair.prefill is None:
        assert pair.transfer_blocks == 0 and pair.reason is not PairReason.DISAGGREGATED
    else:
        assert pair.prefill.role.prefills and pair.prefill.name != pair.decode.name
        assert pair.reason is PairReason.DISAGGREGATED
        assert pair.new_tokens >= cfg.threshold_tokens
        # A hop is made only where it finishes the prompt sooner than the decode replica would.
        assert prefill_cost(pair.prefill, inp) < local_cost(pair.decode, pair.new_tokens, cfg)
        assert 0 <= pair.transfer_blocks <= inp.prompt_tokens // cfg.block_tokens
    if pair.new_tokens < cfg.threshold_tokens:
        assert pair.prefill is None
    pin = next((s for s in inp.candidates if s.name == inp.pinned), None)
    if pin is not None and pin.role.decodes:
        assert pair.decode.name == pin.name and pair.sticky
    # The order candidates come in changes nothing.
    shuffled = list(inp.candidates)
    rnd.shuffle(shuffled)
    again = pair_for(
        PairInputs(tuple(shuffled), inp.prompt_tokens, inp.cached_tokens, inp.pinned), cfg, pair.decode.name
    )
    assert (again.decode, again.prefill, again.reason) == (pair.decode, pair.prefill, pair.reason)
