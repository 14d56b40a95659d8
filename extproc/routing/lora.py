"""LoRA adapters: a filter that drops replicas whose adapter slots other adapters take all (sending
the request there would force a swap), and a scorer that prefers replicas with the adapter loaded."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from extproc.routing.model import ReplicaState
from extproc.routing.plugins import CycleState


def adapter_requested(model: str, candidates: Sequence[ReplicaState]) -> bool:
    """Whether ``model`` names a LoRA adapter: listed by some replica (loaded or waiting), or asked
    of a fleet that serves adapters while no replica serves it as a base model."""
    if not model or not any(c.max_lora for c in candidates):
        return False
    if any(model in c.adapters or model in c.adapters_waiting for c in candidates):
        return True
    bases = [c.models for c in candidates if c.models]
    return bool(bases) and not any(model in b for b in bases)


@dataclass(slots=True)
class LoraFilter:
    """For a known LoRA adapter, drops replicas whose adapter slots (``max_lora``) are all taken by
    other adapters: sending it there would force an adapter swap. Keeps all if every one is full."""

    name: str = "lora"

    def filter(self, cycle: CycleState, candidates: list[ReplicaState]) -> list[ReplicaState]:
        """Drop replicas that cannot take the adapter without evicting another."""
        model = cycle.features.model
        if not adapter_requested(model, candidates):
            return candidates
        kept = [
            c
            for c in candidates
            if model in c.adapters or model in c.adapters_waiting or not c.max_lora or len(c.adapters) < c.max_lora
        ]
        return kept or candidates

    def why(self, state: ReplicaState) -> str:
        """Its adapter slots are taken."""
        return "does not serve the requested adapter"


@dataclass(slots=True)
class LoraScorer:
    """For a LoRA adapter (the requested model name, as replicas list it in
    ``vllm:lora_requests_info``): loaded beats waiting beats a free adapter slot beats a full one,
    so an adapter is loaded once and reused, and ``max_lora`` is respected where possible."""

    name: str = "lora"

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """Score each candidate's readiness for the adapter."""
        model = cycle.features.model
        if not adapter_requested(model, candidates):
            return {}
        out = {}
        for c in candidates:
            if model in c.adapters:
                out[c.name] = 1.0
            elif model in c.adapters_waiting:
                out[c.name] = 0.6
            elif c.max_lora and len(c.adapters) < c.max_lora:
                out[c.name] = 0.3
            else:
                out[c.name] = 0.0
        return out
