"""The pair inside the decision (extproc.routing.pipeline): where candidates carry roles, the decode
replica is the pipeline's pick among those that decode and the prefill hop is weighed after; a
fleet without roles decides as before."""

from __future__ import annotations

from extproc.request.features import RequestFeatures
from extproc.routing import AffinityView, DecisionInputs, Replica, ReplicaState, Snapshot, build_profile, decide
from extproc.routing.disagg import PairSettings
from extproc.routing.model import Decision, Reason
from extproc.routing.roles import ROLE_LABEL, PairReason
from extproc.routing.trace import DecisionTrace

CHAT = "/v1/chat/completions"
LLM_D = PairSettings(weigh_local=False)  # a hop whenever the decode replica lacks 256 tokens


def state(name: str, role: str | None = None, **load: int) -> ReplicaState:
    labels = {ROLE_LABEL: role} if role is not None else {}
    return ReplicaState(Replica(name, f"{name}.local:8000", labels=labels), **load)  # type: ignore[arg-type]


ROLES = Snapshot((state("p0", "prefill"), state("p1", "prefill"), state("d0", "decode"), state("d1", "decode")))


def features(session: str, prompt_chars: int, blocks: int = 0) -> RequestFeatures:
    return RequestFeatures(
        path=CHAT, model="m", session_key=session, prompt_chars=prompt_chars, prefix_hashes=tuple(range(blocks))
    )


def decided(
    f: RequestFeatures, snap: Snapshot = ROLES, view: AffinityView | None = None, pairing: PairSettings = LLM_D
) -> Decision:
    return decide(DecisionInputs.of(f, snap, view or AffinityView(), 0.0, build_profile(), pairing=pairing))


def test_a_prefill_only_replica_is_never_the_decode_target_nor_a_fallback() -> None:
    for i in range(60):
        d = decided(features(f"s{i}", 4000 if i % 2 else 40))
        assert d.replica is not None and d.replica.name in {"d0", "d1"}
        assert {f.name for f in d.fallbacks} <= {"d0", "d1"}
        assert d.pair is not None


def test_a_long_new_prompt_names_a_prefill_replica_and_the_blocks_that_cross() -> None:
    d = decided(features("s", 4000))  # about 1000 tokens, none held anywhere
    assert d.pair is PairReason.DISAGGREGATED
    assert d.prefill is not None and d.prefill.name in {"p0", "p1"}
    assert d.transfer_blocks == 1000 // 16


def test_short_and_held_prompts_stay_on_the_decode_replica() -> None:
    short = decided(features("s", 400))
    assert short.pair is PairReason.SHORT and short.prefill is None
    # d1 holds 60 of the prompt's 64 blocks (of 64 characters): 64 tokens lack, below 256.
    view = AffinityView(pinned="d1", prefix_matches={"d1": 60})
    held = decided(features("s", 64 * 64, blocks=64), view=view)
    assert held.replica is not None and held.replica.name == "d1" and held.reason is Reason.STICKY
    assert held.pair is PairReason.HELD and held.prefill is None


def test_a_session_stays_on_its_decode_replica_and_hops_for_what_it_lacks() -> None:
    view = AffinityView(pinned="d0", prefix_matches={"d0": 10})
    d = decided(features("s", 64 * 64, blocks=64), view=view)
    assert d.replica is not None and d.replica.name == "d0" and d.reason is Reason.STICKY
    assert d.pair is PairReason.DISAGGREGATED and d.prefill is not None
    assert d.transfer_blocks == (64 * 16) // 16 - (10 * 16) // 16


def test_weighing_local_keeps_an_idle_decode_replica_prefilling_itself_and_hops_off_a_busy_one() -> None:
    weighed = PairSettings()
    assert decided(features("s", 4000), pairing=weighed).pair is PairReason.LOCAL
    busy = Snapshot((state("p0", "prefill"), state("d0", "decode", running=30)))
    d = decided(features("s", 4000), busy, pairing=weighed)
    assert d.pair is PairReason.DISAGGREGATED and d.prefill is not None and d.prefill.name == "p0"


def test_without_a_decode_capable_candidate_there_is_no_replica() -> None:
    only_prefill = Snapshot((state("p0", "prefill"), state("p1", "prefill")))
    d = decided(features("s", 4000), only_prefill)
    assert d.replica is None and d.reason is Reason.NO_REPLICA and d.pair is PairReason.NO_DECODER


def test_a_fleet_without_roles_decides_as_before_and_has_no_pair() -> None:
    plain = Snapshot(tuple(state(f"r{i}") for i in range(4)))
    for i in range(30):
        f = features(f"s{i}", 4000, blocks=8)
        with_pairing = decided(f, plain)
        assert with_pairing.pair is None and with_pairing.prefill is None
        assert with_pairing == decide(DecisionInputs.of(f, plain, AffinityView(), 0.0, build_profile()))


def test_the_trace_names_the_role_step_and_a_pin_on_a_prefill_replica_moves_by_it() -> None:
    trace = DecisionTrace()
    f = features("s", 4000)
    view = AffinityView(pinned="p0")  # pinned before the fleet had roles
    d = decide(DecisionInputs.of(f, ROLES, view, 0.0, build_profile(), pairing=LLM_D), trace=trace)
    assert d.replica is not None and d.replica.name in {"d0", "d1"} and d.moved_by == "role"
    removed = trace.removed_by()
    assert removed["p0"] == ("role", "prefill only (llm-d.ai/role)") and "p1" in removed
    assert set(trace.totals) == {"d0", "d1"}
    assert d == decide(DecisionInputs.of(f, ROLES, view, 0.0, build_profile(), pairing=LLM_D))
