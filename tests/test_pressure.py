"""KV pressure: the working-set figure, the bench's ``--kv-blocks`` levels, and the prefix index's
model of what a replica of a given capacity still holds."""

from __future__ import annotations

from extproc.bench.pressure import format_sweep, parse_levels, run_sweep
from extproc.bench.routing import BenchSetup
from extproc.bench.workloads import WorkloadSpec
from extproc.sim.pressure import working_set
from extproc.sim.workload import SimRequest, Workload


def _req(i: int, keys: tuple[int, ...]) -> SimRequest:
    return SimRequest(index=i, arrival_s=float(i), prompt_tokens=16 * len(keys), output_tokens=1, keys=keys)


def test_working_set_counts_blocks_from_first_to_last_use() -> None:
    # Block 1 is used by requests 0..2 (live at 3 requests), block 2 by 0..1 (2), block 3 once (0).
    wl = Workload("w", [_req(0, (1, 2, 3)), _req(1, (1, 2)), _req(2, (1,)), _req(3, (9,))])
    p = working_set(wl, replicas=2, num_gpu_blocks=1)
    assert p.capacity_tokens == 32
    assert p.peak_live_tokens == 32
    assert p.mean_live_tokens == (32 + 32 + 16 + 0) / 4
    assert p.mean_ratio == 80 / 4 / 32


def test_parse_levels_rejects_nonsense() -> None:
    assert parse_levels("3000, 6000") == [3000, 6000]
    for bad in ("", "0", "-5,100"):
        try:
            parse_levels(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} accepted")


def test_a_sweep_runs_each_level_with_its_capacity() -> None:
    setup = BenchSetup(WorkloadSpec("multi-turn", limit=300), replicas=4)
    results = run_sweep(setup, [200, 4000], ["round_robin", "pooled"], show_progress=False)
    small, large = (r.workload for r in results)
    assert (small["kv_blocks_per_replica"], large["kv_blocks_per_replica"]) == (200, 4000)
    assert abs(small["working_set_ratio"] - 20 * large["working_set_ratio"]) < 0.01
    # Less cache, fewer hits, for the ceiling and for a real policy.
    hit = [{n: r.figures["hit_ratio"] for n, r in res.results.items()} for res in results]
    assert hit[0]["pooled"] < hit[1]["pooled"]
    assert hit[0]["round_robin"] < hit[1]["round_robin"]
    table = format_sweep(results)
    assert "| 200 |" in table and "| 4,000 |" in table
