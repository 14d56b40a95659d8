"""The price (extproc/routing/price.py): one figure in predicted seconds per candidate, and the
decisions that follow from it (stickiness, spillover, new conversations, missing evidence)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from extproc.base.engine_rates import EngineRates, PoolRates
from extproc.request.conversation import ConversationChain
from extproc.request.features import RequestFeatures
from extproc.routing.latency import LatencyFit, LatencyView, LearnedRates
from extproc.routing.model import AffinityView, Reason, Replica, ReplicaState, Snapshot
from extproc.routing.pipeline import DecisionInputs, decide
from extproc.routing.price_settings import PriceSettings
from extproc.routing.rates import DEFAULT_RATES, fit_rates
from extproc.routing.registry import PRICE_PROFILE, ProfileError, build_profile
from extproc.routing.trace import DecisionTrace

BLOCK_CHARS = 64  # 16 tokens a block at four characters a token
RATE = DEFAULT_RATES.prefill_tokens_per_s


def request(blocks: int = 250, session: str | None = "s", output: int | None = 100) -> RequestFeatures:
    """A prompt of ``blocks`` blocks of 16 tokens (250: 4,000 tokens)."""
    return RequestFeatures(
        path="/v1/chat/completions",
        model="m",
        session_key=session,
        prompt_chars=blocks * BLOCK_CHARS,
        prefix_hashes=tuple(range(blocks)),
        max_output_tokens=output,
    )


def state(name: str, labels: dict[str, str] | None = None, **load: float) -> ReplicaState:
    return ReplicaState(Replica(name, f"{name}:8000", labels=labels or {}), **load)  # type: ignore[arg-type]


def run(
    replicas: list[ReplicaState],
    view: AffinityView,
    features: RequestFeatures | None = None,
    latency: LatencyView | None = None,
    parameters: dict[str, object] | None = None,
) -> tuple[str, Reason, str, bool, DecisionTrace]:
    spec = dict(PRICE_PROFILE)
    if parameters:
        spec["picker"] = {"type": "price", "parameters": parameters}
    profile = build_profile(spec)
    trace = DecisionTrace()
    given = DecisionInputs.of(features or request(), Snapshot(tuple(replicas)), view, 0.0, profile, latency=latency)
    d = decide(given, trace)
    assert d.replica is not None
    return d.replica.name, d.reason, d.moved_by, d.pin, trace


def test_staying_is_cheap_where_the_history_is_cached() -> None:
    # The pinned replica holds 240 of 250 blocks but has 2,000 tokens of prefill queued: staying
    # costs 0.1 s of queue and 160 tokens, moving 4,000 tokens cold on an idle replica (0.2 s).
    view = AffinityView(pinned="a", prefix_matches={"a": 240})
    name, reason, moved_by, _, trace = run([state("a", pending_prefill_tokens=2000, inflight=2), state("b")], view)
    assert (name, reason, moved_by) == ("a", Reason.STICKY, "")
    a, b = trace.prices["a"], trace.prices["b"]
    assert a.uncached_tokens == 160 and b.uncached_tokens == 4000
    # Each 2,048-token chunk (less the batch's two decode tokens) also waits for a decode step
    # of the batch: one step for its own 160 tokens, one more for the 2,000 queued before them.
    step = DEFAULT_RATES.decode_step_s(3)
    assert a.prefill_s == pytest.approx(160 / RATE + step) and a.queue_s == pytest.approx(2000 / RATE + step)
    assert b.move_s > 0 and a.move_s == 0
    assert a.total_s < b.total_s


def test_a_session_leaves_only_when_waiting_costs_more_than_recomputing() -> None:
    # 20,000 tokens queued on the pin (1 s) against a cold 4,000-token prefill elsewhere (0.2 s).
    view = AffinityView(pinned="a", prefix_matches={"a": 240})
    name, reason, moved_by, pin, trace = run([state("a", pending_prefill_tokens=20_000, inflight=8), state("b")], view)
    assert (name, reason, moved_by) == ("b", Reason.SPILLOVER, "price")
    assert pin  # the session follows its history to where it was just prefilled
    assert trace.prices["b"].total_s < trace.prices["a"].total_s


def test_hysteresis_keeps_a_session_where_prices_are_about_equal() -> None:
    # Both hold nothing of it (a lost pin): without the margin b is cheaper by its smaller queue.
    view = AffinityView(pinned="a", prefix_matches={}, pin_lost="hit_counters")
    replicas = [state("a", pending_prefill_tokens=400), state("b", pending_prefill_tokens=0)]
    assert run(replicas, view)[0] == "a"
    assert run(replicas, view, parameters={"hysteresis": 0.0, "hysteresis_s": 0.0})[0] == "b"


def test_a_full_cache_costs_a_wait_not_a_removal() -> None:
    # Every replica's KV is 97% full with running requests, as on a real engine under pressure:
    # the pinned one, which needs room only for the new part of the turn, keeps the session.
    full = {"kv_usage": 0.97, "kv_capacity_tokens": 50_000, "running": 20, "inflight": 20}
    view = AffinityView(pinned="a", prefix_matches={"a": 240})
    name, reason, _, _, trace = run([state("a", **full), state("b", **full)], view)
    assert (name, reason) == ("a", Reason.STICKY)
    assert trace.prices["b"].kv_wait_s > 0 == trace.prices["a"].kv_wait_s  # 160 tokens still fit there
    # A replica with room is worth the recompute when the pinned one, lacking half of the prompt,
    # must wait long for the KV it needs.
    roomy = state("b", kv_usage=0.1, kv_capacity_tokens=50_000)
    crammed = state("a", kv_usage=1.0, kv_capacity_tokens=50_000, running=20, inflight=20)
    half = AffinityView(pinned="a", prefix_matches={"a": 125}, pin_lost="kv_events")
    assert run([crammed, roomy], half, request(output=2000))[0] == "b"


def test_a_new_conversation_pays_for_the_next_turns_of_the_live_ones() -> None:
    # The same system prompt everywhere: the replica carrying fewer live conversations wins.
    view = AffinityView(prefix_matches={"a": 100, "b": 100})
    name, reason, _, _, trace = run([state("a", live_sessions=12), state("b", live_sessions=2)], view)
    assert name == "b" and reason is Reason.PREFIX
    assert trace.prices["a"].future_s == pytest.approx(12 * 512 / RATE)
    # A pinned session's next turns are part of that load already: no future part.
    pinned = run([state("a", live_sessions=12), state("b")], AffinityView(pinned="a", prefix_matches={"a": 100}))
    assert pinned[4].prices["a"].future_s == 0.0
    # A request without a session has no next turns.
    assert run([state("a", live_sessions=12)], view, request(session=None))[4].prices["a"].future_s == 0.0


def test_a_keyless_history_the_router_does_not_remember_is_not_a_new_conversation() -> None:
    # Its messages continue a conversation no request the router saw ended with ("unmatched"):
    # the conversation lives where its blocks are, so the replica holding them is not charged the
    # next turns of the conversations live there (charged, it lost to an empty replica: 12 x 512
    # tokens against the 4,000 it holds).
    view = AffinityView(prefix_matches={"a": 250})
    chain = ConversationChain(end=1, turn=2, messages=3, conversation=7, match="unmatched")
    unmatched = replace(request(session="conv-0000000000000007"), conversation=chain)
    name, _, _, _, trace = run([state("a", live_sessions=12), state("b")], view, unmatched)
    assert name == "a" and trace.prices["a"].future_s == 0.0
    opened = replace(unmatched, conversation=replace(chain, match="new", turn=None))
    assert run([state("a", live_sessions=12), state("b")], view, opened)[4].prices["a"].future_s > 0


def test_missing_evidence_degrades_to_the_prior() -> None:
    view = AffinityView(prefix_matches={})
    cold = LatencyFit(ttft=(0.0,) * 7, tpot=(0.0,) * 4)  # not warm: no rate
    traced = run([state("a")], view, latency=LatencyView(fits={"a": cold}))[4]
    assert traced.prices["a"].rates.source == "prior"
    assert traced.prices["a"].rates.prefill_tokens_per_s == RATE
    # A warm fit whose prefill term is not positive says nothing of the rate: never free prefill.
    flat = LatencyFit(ttft=(0.01, -0.5, 0, 0, 0, 0, 0), tpot=(0.0, 0.0, 0, 0), ttft_warm=True, tpot_warm=True)
    assert fit_rates(flat).prefill_tokens_per_s is None
    traced = run([state("a")], view, latency=LatencyView(fits={"a": flat}))[4]
    assert traced.prices["a"].rates.prefill_tokens_per_s == RATE
    # A learned rate 100x the prior is a fit's artefact, not a replica that prefills for free.
    absurd = LatencyView(rates={"a": LearnedRates(prefill_tokens_per_s=RATE * 100)})
    assert run([state("a")], view, latency=absurd)[4].prices["a"].rates.source == "prior"


def test_a_replica_slower_than_the_built_in_prior_is_priced_at_its_learned_rates() -> None:
    # The built-in prior is an H100's: a CPU engine 20x slower is what it is, not an artefact.
    view = AffinityView(prefix_matches={})
    slow = LatencyView(rates={"a": LearnedRates(RATE / 20, DEFAULT_RATES.decode_s_per_token * 20)})
    p = run([state("a")], view, latency=slow)[4].prices["a"]
    assert p.rates.source == "learned"
    assert p.rates.prefill_tokens_per_s == RATE / 20
    assert p.rates.decode_s_per_token == pytest.approx(DEFAULT_RATES.decode_s_per_token * 20)
    # Beyond ``slower_than_built_in`` (100x) it is refused, as is 20x off a calibrated pool prior.
    glacial = LatencyView(rates={"a": LearnedRates(RATE / 200)})
    assert run([state("a")], view, latency=glacial)[4].prices["a"].rates.source == "prior"
    pool = PoolRates({"gpu": "h100"}, EngineRates(RATE, DEFAULT_RATES.decode_s_per_token))
    calibrated = LatencyView(rates=slow.rates, priors=(pool,))
    p = run([state("a", labels={"gpu": "h100"})], view, latency=calibrated)[4].prices["a"]
    assert p.rates.source == "pool:gpu=h100" and p.rates.prefill_tokens_per_s == RATE


def test_learned_rates_and_pool_priors() -> None:
    view = AffinityView(prefix_matches={})
    learned = LatencyView(rates={"a": LearnedRates(prefill_tokens_per_s=RATE / 2)})
    p = run([state("a")], view, latency=learned)[4].prices["a"]
    steps = 2 * DEFAULT_RATES.decode_step_s(1)  # 4,000 tokens in two chunks of 2,048
    assert p.rates.source == "learned" and p.prefill_s == pytest.approx(4000 / (RATE / 2) + steps)
    # A warm fit's prefill term (seconds per thousand uncached tokens) is the rate's inverse.
    fit = LatencyFit(ttft=(0.01, 0.08, 0, 0, 0, 0, 0), tpot=(0.012, 0.016, 0, 0), ttft_warm=True, tpot_warm=True)
    assert fit_rates(fit) == LearnedRates(12_500.0, 0.012, 0.001)
    # The slower pool's prior (health.engine_rates, the rate learner's too) prices its replicas
    # dearer for the same prompt; a replica no pool selects has the built-in prior.
    a100 = PoolRates({"gpu": "a100"}, EngineRates(6500.0, 0.016))
    replicas = [state("a", labels={"gpu": "a100"}), state("h", labels={"gpu": "h100"})]
    name, _, _, _, trace = run(replicas, view, request(session=None), latency=LatencyView(priors=(a100,)))
    assert name == "h" and trace.prices["a"].rates.source == "pool:gpu=a100"
    assert trace.prices["a"].rates.decode_s_per_token == 0.016
    a100_steps = 2 * trace.prices["a"].rates.decode_step_s(1)  # the pool's own decode step
    assert trace.prices["a"].prefill_s == pytest.approx(4000 / 6500.0 + a100_steps)
    assert trace.prices["h"].rates == DEFAULT_RATES


def test_the_price_is_configured_by_name_and_checked() -> None:
    with pytest.raises(ProfileError):
        build_profile({**PRICE_PROFILE, "picker": {"type": "price", "parameters": {"prefill_rate": 1}}})
    # The rates' prior is the pools' (health.engine_rates), not the price's: no second place.
    for moved in ({"pools": {"gpu=a100": {}}}, {"prefill_tokens_per_s": 20000}):
        with pytest.raises(ProfileError):
            build_profile({**PRICE_PROFILE, "picker": {"type": "price", "parameters": moved}})
    with pytest.raises(ValueError):
        PriceSettings(output_tokens=0)
    # As a scorer in a weighted profile, it scores the cheapest 1.
    spec = {**PRICE_PROFILE, "scorers": [{"type": "price", "weight": 1}], "picker": {"type": "max_score"}}
    profile = build_profile(spec)
    given = DecisionInputs.of(
        request(), Snapshot((state("a", pending_prefill_tokens=8000), state("b"))), AffinityView(), 0.0, profile
    )
    trace = DecisionTrace()
    assert decide(given, trace).replica.name == "b"  # type: ignore[union-attr]
    assert trace.scorers[0].raw["b"] == 1.0 and trace.scorers[0].raw["a"] < 1.0


def test_a_pin_the_index_forgot_is_not_a_pin_lost() -> None:
    # The index no longer claims the prompt on the pin, but nothing says the replica lost it:
    # it is priced as lacking at most the turn's new part, and the session stays.
    replicas = [state("a", pending_prefill_tokens=1000), state("b")]
    forgot = run(replicas, AffinityView(pinned="a", prefix_matches={}))
    assert forgot[0] == "a" and forgot[4].prices["a"].uncached_tokens == 512
    # Its own word that the cache is gone: the index's figure stands, and the cheaper replica wins.
    lost = run(
        replicas, AffinityView(pinned="a", prefix_matches={}, pin_lost="kv_events"), parameters={"hysteresis": 0.0}
    )
    assert lost[0] == "b" and lost[4].prices["a"].uncached_tokens == 4000


def test_a_copy_of_a_prefix_elsewhere_is_not_free() -> None:
    # No session: a holds the whole prompt behind 5,000 queued tokens (0.25 s); b is idle and
    # cold (4,000 tokens, 0.2 s, and the cached prefixes they displace there, 0.2 s more).
    replicas = [state("a", pending_prefill_tokens=5000), state("b")]
    view = AffinityView(prefix_matches={"a": 250})
    name, _, _, _, trace = run(replicas, view, request(session=None))
    assert name == "a" and trace.prices["b"].others_s == pytest.approx(4000 / RATE)
    # Counting this request's own wait alone, the idle replica wins.
    alone: dict[str, object] = {"evict_weight": 0.0, "prefix_hysteresis": 0.0}
    assert run(replicas, view, request(session=None), parameters=alone)[0] == "b"


def test_a_copy_into_a_cache_with_room_displaces_nothing() -> None:
    # The same choice, but b's cache (64k tokens) is known and nothing was written there yet: the
    # copy displaces nothing and leaving the holder needs no margin, so the idle replica wins.
    replicas = [state("a", pending_prefill_tokens=5000), state("b", kv_capacity_tokens=64_000, cache_fill=0.0)]
    view = AffinityView(prefix_matches={"a": 250})
    name, _, _, _, trace = run(replicas, view, request(session=None))
    assert name == "b" and trace.prices["b"].move_s == 0.0
    assert trace.prices["b"].others_s < 4000 / RATE


def test_a_request_leaves_its_prefix_holder_only_for_a_clear_saving() -> None:
    # No session, b idle and cold, a holding the prompt behind a queue just over b's cold prefill
    # and displacement: the greedy price would move; the prefix margin keeps it on the holder.
    replicas = [state("a", pending_prefill_tokens=8200), state("b")]
    view = AffinityView(prefix_matches={"a": 250})
    name, _, _, _, trace = run(replicas, view, request(session=None))
    assert name == "a" and trace.prices["b"].move_s > 0.0
    assert run(replicas, view, request(session=None), parameters={"prefix_hysteresis": 0.0})[0] == "b"


def test_the_real_stack_bench_runs_the_price_profile_as_a_user_would_configure_it() -> None:
    # `bench realstack --routers extproc_price`: our processor with benchmarks/routing/price.yaml
    # and the engines' block size, a config the processor loads and builds a price picker from.
    import os
    from pathlib import Path

    from extproc.config import load_config
    from extproc_lab.bench.realstack import OURS_PRICE, RealStackSetup, _price_args

    setup = RealStackSetup(engine="vllm", routers=(OURS_PRICE,), kv_blocks=128)
    setup.check()
    flag, path = _price_args(setup)
    try:
        config = load_config(path)
        assert flag == "--config" and config.kv_events.block_size == 32
        assert build_profile(config.profile).picker.name == "price"
    finally:
        os.unlink(Path(path))


def test_the_realstack_gives_the_price_the_calibrated_prior_on_request() -> None:
    """``--price-config benchmarks/routing/cpu-small-rates.yaml``: extproc_price's config carries the
    CPU engines' calibrated rates for every replica, the profile and block size kept."""
    import os
    from pathlib import Path

    from extproc.config import load_config
    from extproc_lab.bench.realstack import OURS_PRICE, PRICE_PROFILE_FILE, RealStackSetup, _price_args

    rates_file = PRICE_PROFILE_FILE.parent / "cpu-small-rates.yaml"
    setup = RealStackSetup(engine="vllm", routers=(OURS_PRICE,), kv_blocks=128, price_config=rates_file)
    _, path = _price_args(setup)
    try:
        config = load_config(path)
        assert config.kv_events.block_size == 32
        assert build_profile(config.profile).picker.name == "price"
        (prior,) = [r.pool() for r in config.health.engine_rates]
        assert prior.labels == {} and prior.rates.prefill_tokens_per_s == 12794.7
        assert prior.rates.overhead_s == 0.010642 and prior.rates.decode_step_s == 0.003983
    finally:
        os.unlink(Path(path))


def test_requests_the_engine_reports_waiting_are_priced_where_the_router_sent_fewer() -> None:
    # Fifty requests waiting by the engine's own page (another gateway's): the session leaves for
    # a replica where recomputing its history costs less than that queue; its own prefill, had it
    # sent more, would count instead.
    view = AffinityView(pinned="a", prefix_matches={"a": 240})
    name, reason, moved_by, _, trace = run([state("a", queue=50), state("b")], view)
    assert trace.prices["a"].queue_s >= 50 * 256 / RATE
    assert (name, reason, moved_by) == ("b", Reason.SPILLOVER, "price")
    _, _, _, _, trace = run([state("a", queue=2, pending_prefill_tokens=20_000), state("b")], view)
    assert trace.prices["a"].queue_s == pytest.approx(20_000 / RATE, rel=0.2)


def test_a_lora_adapter_not_held_costs_its_load() -> None:
    # The adapter "sql" is loaded on "a", a slot is free on "b": "b" is priced its load, so the
    # adapter's requests stay on "a" unless what waits there costs more than loading it on "b".
    sql = replace(request(session=None), model="sql")
    held = ReplicaState(Replica("a", "a:8000"), adapters=frozenset({"sql"}), max_lora=2, models=frozenset({"m"}))
    free = ReplicaState(Replica("b", "b:8000"), max_lora=2, models=frozenset({"m"}))
    name, _, _, _, trace = run([free, held], AffinityView(prefix_matches={}), sql)
    assert name == "a"
    assert trace.prices["b"].adapter_s == pytest.approx(0.3) and trace.prices["a"].adapter_s == 0.0
    busy = replace(held, pending_prefill_tokens=20_000, inflight=5)  # over a second of prefill ahead
    assert run([free, busy], AffinityView(prefix_matches={}), sql)[0] == "b"
    # The base model loads nothing anywhere.
    base = run([free, held], AffinityView(prefix_matches={}), request(session=None))[4]
    assert base.prices["a"].adapter_s == base.prices["b"].adapter_s == 0.0


def test_a_max_tokens_beyond_any_likely_answer_is_not_the_expected_output() -> None:
    # A pinned replica with a batch running: a huge max_tokens (a cap, not an expectation) prices
    # the batch's stall as for the usual output, so the session stays where its history is.
    busy = state("a", inflight=8, running=8, kv_capacity_tokens=200_000, kv_usage=0.2)
    pin = AffinityView(pinned="a", prefix_matches={"a": 250})
    huge = run([busy, state("b")], pin, request(output=1_000_000))
    assert huge[0] == "a"
    usual = run([busy, state("b")], pin, request(output=None))[4].prices["a"]
    assert huge[4].prices["a"].others_s == pytest.approx(usual.others_s)
    # One within max_output_tokens is read as the answer's length, shorter or longer than the usual.
    short = run([busy, state("b")], pin, request(output=16))[4].prices["a"]
    long = run([busy, state("b")], pin, request(output=4096))[4].prices["a"]
    assert short.others_s < usual.others_s < long.others_s


def test_without_a_usable_max_tokens_the_models_learned_answer_length_is_expected() -> None:
    busy = state("a", inflight=8, running=8, kv_capacity_tokens=200_000, kv_usage=0.2)
    pin = AffinityView(pinned="a", prefix_matches={"a": 250})

    def others_s(output: int | None, learned: dict[str, float]) -> float:
        view = LatencyView(output_tokens=learned)
        return run([busy, state("b")], pin, request(output=output), latency=view)[4].prices["a"].others_s

    usual = others_s(None, {})
    # The model's answers came to 40 tokens on average: that, not 256, for no max_tokens or a huge one.
    assert others_s(None, {"m": 40.0}) < usual
    assert others_s(None, {"m": 40.0}) == pytest.approx(others_s(40, {}))
    assert others_s(1_000_000, {"m": 40.0}) == pytest.approx(others_s(40, {}))
    # Another model's answers say nothing of this one's; a max_tokens within the cap still decides.
    assert others_s(None, {"other": 40.0}) == pytest.approx(usual)
    assert others_s(1000, {"m": 40.0}) == pytest.approx(others_s(1000, {}))


def test_a_new_conversation_goes_where_the_working_sets_still_fit_else_where_they_already_do_not() -> None:
    # 8,000-token caches; the new conversation's history is 4,000 tokens (250 blocks, none held).
    # "full" holds 6,000 tokens of conversations due back: it would overflow them all. "thrashing"
    # is past its cache already (10,000): nothing there survives anyway. "room" has 3,000.
    cache = {"kv_capacity_tokens": 8000}
    parameters: dict[str, object] = {"working_set_weight": 1.0, "session_tokens": 0}
    full = state("full", working_set_tokens=6000, **cache)
    thrashing = state("thrashing", working_set_tokens=10_000, **cache)
    room = state("room", working_set_tokens=3000, **cache)
    name, *_, trace = run([full, thrashing, room], AffinityView(), parameters=parameters)
    assert name == "room" and trace.prices["room"].future_s == 0
    # Without room: half its history and half theirs where it tips the cache over; where the cache
    # overflows already, its own history, the less the more it overflows (8,000 / 10,000 of it).
    name, *_, trace = run([full, thrashing], AffinityView(), parameters=parameters)
    assert name == "thrashing"
    assert trace.prices["full"].future_s == pytest.approx((0.5 * 4000 + 0.5 * 6000) / RATE)
    assert trace.prices["thrashing"].future_s == pytest.approx(4000 * 0.8 / RATE)
    fuller = state("fuller", working_set_tokens=20_000, **cache)
    assert run([thrashing, fuller], AffinityView(), parameters=parameters)[0] == "fuller"
    # Its own history counts once where it is pinned: there it is part of what is due back.
    pinned = AffinityView(pinned="full", prefix_matches={"full": 250})
    *_, trace = run([full, room], pinned, parameters=parameters)
    assert trace.prices["full"].future_s == 0
    # Off by default: the working sets price nothing.
    *_, trace = run([full, thrashing], AffinityView(), parameters={"session_tokens": 0})
    assert trace.prices["full"].future_s == trace.prices["thrashing"].future_s == 0
