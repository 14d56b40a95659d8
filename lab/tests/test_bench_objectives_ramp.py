"""``extproc bench objectives-ramp``: the client's judgement of a request, the figures, the
processor configs, and a tiny real run (probe, our router with objectives, Envoy's round robin)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from extproc.api import load_config
from extproc_lab.bench.objectives_ramp import (
    NO_OBJECTIVES,
    OBJECTIVES,
    OBJECTIVES_QUEUE,
    PREMIUM,
    ROUND_ROBIN,
    STANDARD,
    Outcome,
    RampSetup,
    conversations,
    load_figures,
    router_config,
    run_ramp,
)
from tests.conftest import require_binary


def _served(tier: str, ttft_s: float, tpot_s: float, tokens: int = 16, at: float = 0.0) -> Outcome:
    return Outcome(tier, 0, status=200, complete=True, sent_s=at, ttft_s=ttft_s, tpot_s=tpot_s,
                   completion_tokens=tokens, done_s=at + ttft_s + tpot_s * (tokens - 1))  # fmt: skip


def test_a_request_meets_only_within_both_objectives_and_a_shed_one_counts_as_missed() -> None:
    setup = RampSetup()  # premium 1500 ms / 80 ms, standard 500 ms / 40 ms
    outcomes = [
        _served(PREMIUM, 1.4, 0.070),  # met
        _served(PREMIUM, 1.6, 0.010),  # TTFT missed
        _served(STANDARD, 0.4, 0.030, tokens=10),  # met
        _served(STANDARD, 0.4, 0.050),  # TPOT missed
        Outcome(STANDARD, 1, status=429, sent_s=1.0, done_s=1.01),
        Outcome(STANDARD, 2, status=200, complete=False, sent_s=2.0, ttft_s=0.1, done_s=10.0, error="cut"),
    ]
    row = load_figures(setup, outcomes, offered_rps=3.0)
    assert row["span_s"] == 10.0
    p, s = row["classes"][PREMIUM], row["classes"][STANDARD]
    assert (p["requests"], p["met"], p["shed"], p["failed"]) == (2, 1, 0, 0)
    assert (s["requests"], s["met"], s["shed"], s["failed"], s["served"]) == (4, 1, 1, 1, 2)
    assert s["met_share"] == 0.25 and s["met_of_served"] == 0.5
    # Goodput: the completion tokens of requests that met, over the span.
    assert p["goodput_tps"] == 1.6 and s["goodput_tps"] == 1.0 and row["goodput_tps"] == 2.6
    assert row["first_errors"] == ["cut"]


def test_each_processor_config_loads_and_only_the_objective_rows_act_on_objectives(tmp_path: Path) -> None:
    setup = RampSetup()
    loaded = {}
    for name in (OBJECTIVES, OBJECTIVES_QUEUE, NO_OBJECTIVES):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(router_config(setup, name)))
        loaded[name] = load_config(path)
    assert loaded[NO_OBJECTIVES].health.latency_models == "off"
    assert loaded[OBJECTIVES].queueing.classes[STANDARD].on_miss == "shed"
    assert loaded[OBJECTIVES_QUEUE].queueing.enabled
    assert loaded[OBJECTIVES_QUEUE].queueing.classes[STANDARD].on_miss == "queue"
    for name in (OBJECTIVES, OBJECTIVES_QUEUE):
        assert loaded[name].queueing.classes[PREMIUM].on_miss == "best_effort"


def test_the_plan_is_poisson_at_the_asked_rate_with_both_classes() -> None:
    setup = RampSetup(seconds=100.0, turns=4)
    plan = conversations(setup, rate_rps=8.0, seed=3, run_id="t")
    assert len(plan) == 200  # 2 conversations a second for 100 s
    assert 80 < plan[-1][0] < 120
    premium = sum(1 for _, tier, _ in plan if tier.name == PREMIUM)
    assert 0.2 < premium / len(plan) < 0.4


def test_tiny_ramp_through_envoy_probe_objectives_and_round_robin(tmp_path: Path) -> None:
    """The probe measures a capacity, every request is answered or shed (none lost), premium is
    never shed, and the processor's own shed counter agrees with the client's 429s."""
    require_binary("envoy")
    setup = RampSetup(replicas=2, time_scale=0.2, loads=(1.0,), seconds=2.0, turns=2, gap_s=0.2,
                      probe_s=2.0, probe_warmup_s=0.5, probe_live_per_replica=2,
                      routers=(OBJECTIVES, ROUND_ROBIN), request_timeout_s=20.0)  # fmt: skip
    result = run_ramp(setup, progress=lambda _: None)
    assert result["capacity_probed"] and result["capacity_rps"] > 0
    for name in (OBJECTIVES, ROUND_ROBIN):
        r = result["routers"][name]
        assert "error" not in r, (name, r)
        row = r["loads"]["1"]
        assert row["requests"] > 0 and row["requests"] % setup.turns == 0, name
        for c in row["classes"].values():
            assert c["failed"] == 0, (name, row["first_errors"])
            assert c["not_sent"] == 0, name
            # A shed turn ends its conversation: the rest of it is abandoned, never sent.
            assert c["served"] + c["shed"] + c["abandoned"] == c["requests"], name
            assert c["abandoned"] <= c["shed"] * (setup.turns - 1), name
            assert 0 <= c["met"] <= c["served"]
        assert row["classes"][PREMIUM]["shed"] == 0
        assert 0.0 < row["hit_ratio"] <= 1.0, name  # follow-ups resend the history
    ours = result["routers"][OBJECTIVES]["loads"]["1"]
    shed_by_router = sum(v for k, v in ours["processor"]["shed"].items() if k.startswith(f"{STANDARD}/"))
    assert shed_by_router == ours["classes"][STANDARD]["shed"]
    assert result["routers"][ROUND_ROBIN]["loads"]["1"]["classes"][STANDARD]["shed"] == 0


def test_the_command_rejects_an_unknown_router() -> None:
    argv = [sys.executable, "-m", "extproc", "bench", "objectives-ramp", "--routers", "nginx", "--capacity", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "unknown routers" in done.stderr
    with pytest.raises(ValueError, match="positive"):
        run_ramp(RampSetup(loads=(0.0,)))
    assert json.dumps(RampSetup().loads) == "[0.5, 1.0, 1.5]"
