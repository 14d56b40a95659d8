"""The priority simulation: the server's queue order on a virtual clock."""

from __future__ import annotations

from extproc.api import Config, QueueClass, QueueSettings
from extproc_lab.replica.timing import get_profile
from extproc_lab.sim.generators import merge, unique_prompts
from extproc_lab.sim.priority import PrioritySimulation
from extproc_lab.sim.workload import SimRequest
from extproc_lab.stats import percentile


def _class(req: SimRequest) -> str:
    return "batch" if req.tenant == "batch" else "default"


def test_queueing_keeps_interactive_ttft_low_when_batch_overloads_the_fleet() -> None:
    # Demo replicas (64 sequences, 16k tokens of KV each) under far more batch work than they take.
    batch = unique_prompts(300, seed=1, qps=60, mean_prompt_tokens=800, mean_output_tokens=120, tenant="batch")
    chat = unique_prompts(60, seed=2, qps=12, mean_prompt_tokens=200, mean_output_tokens=20, tenant="chat")
    workload = merge("mix", [batch, chat])
    unlimited = QueueClass(priority=1, max_wait_s=1e9, max_queued=10**9)
    queued = QueueSettings(
        enabled=True,
        max_inflight_per_replica=8,
        default=unlimited,
        classes={"batch": unlimited.model_copy(update={"priority": 0})},
    )
    runs = {}
    for name, settings in (("without", QueueSettings()), ("with", queued)):
        config = Config(queueing=settings)
        runs[name] = PrioritySimulation(workload, get_profile("demo"), 2, None, config, _class).run()
    for run in runs.values():
        assert len(run.served) == len(workload) and not run.refused
    ttft = {
        name: percentile([s.first_token - s.arrival for s in run.served if s.request_class == "default"], 0.99)
        for name, run in runs.items()
    }
    assert runs["with"].max_waiting > 0
    assert ttft["with"] < ttft["without"] / 3, ttft


def test_a_request_held_past_its_limit_is_refused() -> None:
    batch = unique_prompts(200, seed=1, qps=100, mean_prompt_tokens=800, mean_output_tokens=120, tenant="batch")
    settings = QueueSettings(
        enabled=True, max_inflight_per_replica=4, classes={"batch": QueueClass(priority=0, max_wait_s=0.5)}
    )
    run = PrioritySimulation(batch, get_profile("demo"), 1, None, Config(queueing=settings), _class).run()
    assert run.refused.get("timeout", 0) > 0
    assert len(run.served) + run.refused["timeout"] == len(batch)
    assert all(s.dispatched - s.arrival <= 0.5 + 1e-9 for s in run.served)
