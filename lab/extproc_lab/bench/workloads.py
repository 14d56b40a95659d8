"""The workloads of ``extproc bench routing``, by name, rebuilt identically in every worker process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from extproc_lab.sim import generators
from extproc_lab.sim.objectives import ObjectiveClass, assign
from extproc_lab.sim.traces import (
    azure_workload,
    load_azure,
    load_mooncake,
    load_trace_workload,
    mooncake_workload,
    trace_path,
)
from extproc_lab.sim.workload import Workload

WORKLOADS = (
    "multi-turn",
    "shared-prefix",
    "sglang-shared-prefix",
    "mooncake-conversation",
    "mooncake-synthetic",
    "azure-conv",
    "azure-code",
    "tenant-mix",
    "hot-prefix",
    "shared-system-chat",
    "agents",
)


@dataclass(frozen=True)
class WorkloadSpec:
    """A workload by name (or a trace file), with its arrival-rate factor, seed and size limit, and
    the latency objectives its conversations are drawn into (none by default)."""

    name: str = "multi-turn"
    trace: str | None = None
    rate: float = 1.0
    seed: int = 7
    limit: int | None = None
    traces: str | None = None
    objectives: tuple[ObjectiveClass, ...] = ()

    @property
    def label(self) -> str:
        """How reports name it."""
        return Path(self.trace).name.split(".")[0] if self.trace else self.name

    def build(self) -> Workload:
        """Generate or load the workload (deterministic for the spec)."""
        return assign(self._build(), self.objectives, self.seed)

    def _build(self) -> Workload:
        if self.trace:
            return load_trace_workload(self.trace, self.rate, self.limit)
        name, rate, seed = self.name, self.rate, self.seed
        if name == "multi-turn":
            wl = generators.multi_turn(seed=seed, rate=rate)
        elif name == "shared-prefix":
            wl = generators.shared_prefix(seed=seed, rate=rate)
        elif name == "sglang-shared-prefix":
            wl = generators.sglang_shared_prefix(seed=seed, rate=rate)
        elif name == "tenant-mix":
            wl = generators.tenant_mix(seed=seed, rate=rate)
        elif name == "hot-prefix":
            wl = generators.hot_prefix(seed=seed, rate=rate)
        elif name == "shared-system-chat":
            # realstack's shape with a long system prompt and short documents, where the shared
            # prefix is most of every first turn (the case that left replicas idle).
            wl = generators.shared_system_chat(
                96, 6, seed=seed, rate=rate, live=40, system_tokens=2000, document_tokens=300
            )
        elif name == "agents":
            wl = generators.agents(seed=seed, rate=rate)
        elif name in ("mooncake-conversation", "mooncake-synthetic"):
            path = trace_path(name, self.traces)
            wl = mooncake_workload(load_mooncake(path, self.limit), name, rate)
        elif name in ("azure-conv", "azure-code"):
            path = trace_path(name, self.traces)
            wl = azure_workload(load_azure(path, self.limit), name, rate)
        else:
            raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
        if self.limit is not None and len(wl.requests) > self.limit and not name.startswith(("mooncake", "azure")):
            wl = _truncate(wl, self.limit)
        return wl


def _truncate(wl: Workload, limit: int) -> Workload:
    """The first ``limit`` requests (follow-ups of dropped requests are dropped with them)."""
    kept = wl.requests[:limit]
    return Workload(wl.name, kept, {**wl.info, "limit": limit})
