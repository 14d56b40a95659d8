"""The simulator drives the router's own objects; the benchmark is deterministic for a seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extproc.api import DEFAULT_PROFILE, Config, cli_main
from extproc_lab.bench.cli import run_bench_command
from extproc_lab.bench.policies import ALL, policy_profile
from extproc_lab.bench.routing import BenchSetup, format_table, run_bench, verdict
from extproc_lab.bench.workloads import WorkloadSpec
from extproc_lab.replica import PROFILES
from extproc_lab.sim import generators
from extproc_lab.sim.ceilings import ceilings
from extproc_lab.sim.dynamic import DynamicSimulation
from extproc_lab.sim.figures import figures, hit_ratio_series, load_series
from extproc_lab.sim.simulator import Simulation

LLAMA = PROFILES["llama-8b-h100"]
SMALL = WorkloadSpec("multi-turn", rate=1.0, seed=3, limit=250)


def simulate(policy: str, workload_spec: WorkloadSpec = SMALL, replicas: int = 4) -> Simulation:
    cfg = Config()
    wl = workload_spec.build()
    return Simulation(wl, LLAMA, replicas, lambda probe: policy_profile(policy, probe, 7, LLAMA, cfg), config=cfg)


def test_simulation_uses_the_router_and_feeds_it_back() -> None:
    sim = simulate("extproc")
    assert sim.driver.profile.name == "extproc"
    run = sim.run()
    f = figures(run)
    assert f["requests"] == len(sim.workload) == 250
    assert f["sticky_stayed"] == 1.0 and f["decisions"]["sticky"] > 0
    # Every request was released: the router holds nothing in flight.
    assert sim.driver.idle()
    # The replicas' load reached the router through reports, as a scraper's would.
    assert sim.driver.scraped()
    assert 0 < f["hit_ratio"] <= 1 and f["ttft_p50_s"] <= f["ttft_p99_s"] <= f["e2e_p99_s"]
    series = hit_ratio_series(run)
    assert any(v is not None and v > 0.5 for v in series)
    assert len(load_series(run)) == 4


def test_sticky_routing_beats_round_robin_and_stays_under_the_ceilings() -> None:
    ours = figures(simulate("extproc").run())
    rr = figures(simulate("round_robin").run())
    pooled, ideal = ceilings(SMALL.build(), 4, LLAMA.num_gpu_blocks)
    assert rr["hit_ratio"] < ours["hit_ratio"] <= pooled.hit_ratio + 0.01
    assert pooled.hit_ratio <= ideal.hit_ratio
    assert ours["prefill_tokens"] < rr["prefill_tokens"]
    assert rr["load_cv"] < 0.01  # round robin is perfectly even in requests


def test_llmd_precise_reads_the_replicas_true_caches() -> None:
    spec = WorkloadSpec("sglang-shared-prefix", rate=0.25, limit=120)
    sim = simulate("llmd_precise", spec)
    seen: list[dict[str, int]] = []
    probe = sim.probe
    original = probe.cached_tokens

    def spy(features):  # type: ignore[no-untyped-def]
        got = dict(original(features))
        seen.append(got)
        return got

    probe.cached_tokens = spy  # type: ignore[method-assign]
    precise = figures(sim.run())
    rr = figures(simulate("round_robin", spec).run())
    assert precise["hit_ratio"] > rr["hit_ratio"]
    assert len(seen) == 120 and any(max(v.values(), default=0) >= 2048 for v in seen)


def test_benchmark_is_deterministic_for_a_seed() -> None:
    setup = BenchSetup(WorkloadSpec("tenant-mix", rate=2.0, seed=11, limit=500), replicas=4, seed=11)
    policies = ["extproc", "random", "gie_default", "sglang_cache_aware", "pooled"]
    a = run_bench(setup, policies, show_progress=False, in_process=True).to_json()
    b = run_bench(setup, policies, show_progress=False, in_process=True).to_json()
    assert a == b
    other = BenchSetup(WorkloadSpec("tenant-mix", rate=2.0, seed=12, limit=500), replicas=4, seed=12)
    c = run_bench(other, ["random"], show_progress=False, in_process=True).to_json()
    assert c["policies"]["random"] != a["policies"]["random"]


def test_report_table_json_and_verdict() -> None:
    setup = BenchSetup(WorkloadSpec("multi-turn", seed=3, limit=200), replicas=4)
    result = run_bench(setup, ["extproc", "round_robin", "pooled", "ideal"], show_progress=False, in_process=True)
    table = format_table(result)
    assert table.splitlines()[0].startswith("policy") and "extproc *" in table and "pooled" in table
    assert format_table(result, markdown=True).startswith("| policy |")
    data = result.to_json()
    assert data["default_policy"] == "extproc"
    for key in ("hit_ratio", "ttft_p50_s", "ttft_p99_s", "e2e_p99_s", "load_cv", "prefill_tokens", "throughput_rps"):
        assert key in data["policies"]["extproc"]
    assert set(data["policies"]["pooled"]) >= {"hit_ratio", "prefill_tokens"}
    # Where the hit ratio goes: the same workload offers about the same reuse to both; ours
    # captures more of it than round robin.
    ours, rr = data["policies"]["extproc"], data["policies"]["round_robin"]
    assert rr["reuse_offered"] > 0 and abs(ours["reuse_offered"] - rr["reuse_offered"]) < 0.15, (ours, rr)
    assert ours["reuse_captured"] > rr["reuse_captured"] + 0.3, (ours, rr)
    assert "offered" in table.splitlines()[0] and "captured" in table.splitlines()[0]
    assert data["workload"]["name"] == "multi-turn"
    assert any("of pooled" in line for line in verdict(result))


def test_extproc_policy_is_the_router_configs_profile(tmp_path: Path) -> None:
    variant = tmp_path / "v.yaml"
    variant.write_text(json.dumps({"profile": {**DEFAULT_PROFILE, "scorers": [{"type": "load", "weight": 1}]}}))
    setup = BenchSetup(
        WorkloadSpec("multi-turn", seed=3, limit=150), replicas=4, variants=(("load-only", str(variant)),)
    )
    result = run_bench(setup, ["extproc", "load-only"], show_progress=False, in_process=True)
    assert result.results["load-only"].figures["sticky_stayed"] < result.results["extproc"].figures["sticky_stayed"]
    with pytest.raises(ValueError, match="unknown policies"):
        run_bench(setup, ["nope"], show_progress=False, in_process=True)


def test_every_named_policy_builds() -> None:
    sim = simulate("extproc")
    for name in ALL:
        if name not in ("pooled", "ideal"):
            assert policy_profile(name, sim.probe, 1, LLAMA, Config()).name == name


def test_cli_bench_routing_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    argv = [
        "bench",
        "routing",
        "--workload",
        "sglang-shared-prefix",
        "--limit",
        "120",
        "--replicas",
        "3",
        "--policies",
        "extproc,round_robin,pooled",
        "--jobs",
        "1",
        "--json",
        str(out),
        "--quiet",
    ]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "extproc *" in printed and "round_robin" in printed
    data = json.loads(out.read_text())
    assert list(data["policies"]) == ["extproc", "round_robin", "pooled"]
    assert (tmp_path / "r_hit_ratio.png").exists() and (tmp_path / "r_load_heatmap.png").exists()


def test_cli_rejects_a_malformed_variant(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    args = argparse.Namespace(variant=["nonsense"])
    assert run_bench_command(args) == 2
    assert "NAME=FILE" in capsys.readouterr().err


def test_generated_workloads_run_through_the_simulator() -> None:
    for spec in (
        WorkloadSpec("shared-prefix", rate=0.2, limit=60),
        WorkloadSpec("tenant-mix", limit=300),
        WorkloadSpec("azure-conv", limit=150),
        WorkloadSpec("mooncake-synthetic", limit=60),
    ):
        f = figures(simulate("extproc", spec, replicas=3).run())
        assert f["requests"] == len(spec.build())


def test_multi_turn_default_is_sized_for_eight_replicas() -> None:
    wl = generators.multi_turn()
    assert 10_000 < len(wl) < 13_000 and len({r.session for r in wl.requests}) == 1500


def test_the_dynamic_simulation_without_changes_is_the_plain_one() -> None:
    # One event loop: the fleet-change variant adds events and hooks, so without changes (and
    # without a rebalancer that pre-warms) it replays the workload exactly as the plain simulation.
    cfg = Config()
    wl = WorkloadSpec("multi-turn", rate=1.0, seed=3, limit=150).build()
    plain = Simulation(wl, LLAMA, 3, lambda p: policy_profile("extproc", p, 7, LLAMA, cfg), config=cfg).run()
    dynamic = DynamicSimulation(
        wl, LLAMA, 3, lambda p: policy_profile("extproc", p, 7, LLAMA, cfg), config=cfg
    ).run_dynamic()
    assert dynamic.run.outcomes == plain.outcomes and len(plain.outcomes) == 150
    assert dynamic.run.decisions == plain.decisions and dynamic.run.events == plain.events
    assert dynamic.run.requests_series == plain.requests_series
    assert dynamic.run.tokens_series == plain.tokens_series
    assert dynamic.changes == [] and dynamic.prewarms_sent == 0 and not dynamic.refused
