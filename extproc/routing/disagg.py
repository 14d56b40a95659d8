"""The prefill hop of a disaggregated request, for a decode replica already chosen.

A pure function of the candidates' states and what each holds of the prompt, as the rest of the
decision is. The decode replica is the pipeline's choice among the replicas that decode (its
profile's filters, scorers and picker, a session's pin included: :func:`extproc.routing.pipeline.decide`),
because it serves the request longest. Only then is a prefill hop considered, for the tokens that
replica lacks:

- a decode replica holding the previous turns lacks only the new ones, and when they are fewer
  than ``PairSettings.threshold_tokens`` (short prompts, most already held) the request runs
  aggregated on it: a hop costs a round trip and a transfer that a short prefill does not repay;
- otherwise the prefill replica is the one that finishes the prompt soonest: the fewest uncached
  tokens there plus prefill tokens already queued; and the hop is made only if it finishes
  sooner than the decode replica would, computing what it lacks behind its own queued prefills
  and stalling the sequences it decodes meanwhile (a prefill replica computes the whole prompt
  but what it holds, the decode replica only the part it lacks).

Only the blocks the decode replica lacks cross (vLLM's connectors look up the decode replica's
own prefix cache first), so ``Pair.transfer_blocks`` counts those.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from extproc.routing.model import ReplicaState
from extproc.routing.roles import PairReason

__all__ = [
    "Pair",
    "PairInputs",
    "PairReason",
    "PairSettings",
    "choose_prefill",
    "local_cost",
    "prefill_cost",
]


@dataclass(frozen=True, slots=True)
class PairSettings:
    """How the prefill hop is weighed.

    ``threshold_tokens``: tokens the decode replica lacks below which no prefill hop is made
    (llm-d's ``pdThreshold`` plays this part, on the prompt's uncached length). Above it a hop is
    made when the prefill replica would finish the prompt sooner than the decode replica
    (:func:`local_cost`, where ``decode_interference`` weighs the stall of each sequence decoding
    there against the request's own wait); without ``weigh_local`` it is made whenever the
    decode replica lacks ``threshold_tokens`` or more, as llm-d's threshold decider does.
    ``block_tokens`` is the KV block size.
    """

    threshold_tokens: int = 256
    decode_interference: float = 0.1
    block_tokens: int = 16
    weigh_local: bool = True

    def __post_init__(self) -> None:
        if self.threshold_tokens < 0 or self.block_tokens < 1:
            raise ValueError("threshold_tokens must not be negative and block_tokens must be at least 1")
        if self.decode_interference < 0:
            raise ValueError("decode_interference must not be negative")


@dataclass(frozen=True, slots=True)
class PairInputs:
    """What the pair is decided on: the candidates (already filtered: in rotation, serving the
    model, not cordoned), the prompt's length, the tokens of it each replica is believed to hold,
    and the session's decode replica (None: no session or no pin)."""

    candidates: Sequence[ReplicaState]
    prompt_tokens: int
    cached_tokens: Mapping[str, int] = field(default_factory=dict)
    pinned: str | None = None


@dataclass(frozen=True, slots=True)
class Pair:
    """Where a request's decode and prefill go (``prefill`` None: aggregated on ``decode``)."""

    decode: ReplicaState | None
    prefill: ReplicaState | None
    reason: PairReason
    new_tokens: int = 0
    """Prompt tokens the decode replica does not hold."""
    transfer_blocks: int = 0
    """Full KV blocks that cross from the prefill replica to the decode replica."""
    sticky: bool = False
    """Whether the decode replica is the session's pinned one."""
    scores: Mapping[str, float] = field(default_factory=dict)
    """Decode candidates' scores."""


def load_of(state: ReplicaState) -> int:
    """Requests a replica is serving or queueing, as scraped or as counted in flight."""
    return max(state.running + state.queue, state.inflight)


def prefill_cost(state: ReplicaState, inputs: PairInputs) -> int:
    """Tokens a replica must compute before this prompt's are done: its queued prefill tokens
    and the part of the prompt it does not hold."""
    held = min(inputs.prompt_tokens, inputs.cached_tokens.get(state.name, 0))
    return state.pending_prefill_tokens + inputs.prompt_tokens - held


def local_cost(state: ReplicaState, new_tokens: int, settings: PairSettings) -> float:
    """What computing ``new_tokens`` on the decode replica itself costs (vLLM's decode instances
    can prefill), in prompt tokens: its queued prefill tokens and these, plus the stall of the
    sequences it is decoding (each waits for these tokens, weighed by ``decode_interference``)."""
    return state.pending_prefill_tokens + new_tokens * (1.0 + settings.decode_interference * load_of(state))


def choose_prefill(
    inputs: PairInputs,
    decode: ReplicaState,
    settings: PairSettings | None = None,
    scores: Mapping[str, float] | None = None,
    cost: Callable[[ReplicaState], float] | None = None,
) -> Pair:
    """Whether and where to prefill for ``decode``, a decode replica already chosen (by the
    pipeline's filters, scorers and picker among the decode-capable candidates): the module
    docstring's steps. ``scores`` are carried into the pair. Given ``cost`` (the price's seconds
    of prefilling the request on a replica: its time to first token there and the stall of the
    batch there), the prefill replica is the cheapest and the hop is made only where it is
    cheaper than the decode replica itself, in place of the token counts (:func:`prefill_cost`,
    :func:`local_cost`); ``threshold_tokens`` still gates the hop (the price has no term for its
    round trip and transfer)."""
    settings = settings or PairSettings()
    held = min(inputs.prompt_tokens, max(0, inputs.cached_tokens.get(decode.name, 0)))
    new_tokens = inputs.prompt_tokens - held
    sticky = decode.name == inputs.pinned
    scores = scores if scores is not None else {}

    def aggregated(reason: PairReason) -> Pair:
        return Pair(decode, None, reason, new_tokens, 0, sticky, scores)

    if new_tokens < settings.threshold_tokens:
        return aggregated(PairReason.SHORT if inputs.prompt_tokens < settings.threshold_tokens else PairReason.HELD)
    prefillers = [s for s in inputs.candidates if s.role.prefills and s.name != decode.name]
    if not prefillers:
        return aggregated(PairReason.NO_PREFILLER)
    if cost is not None:
        prefill = min(prefillers, key=lambda s: (cost(s), s.name))
        if settings.weigh_local and cost(decode) <= cost(prefill):
            return aggregated(PairReason.LOCAL)
    else:
        prefill = min(prefillers, key=lambda s: (prefill_cost(s, inputs), s.name))
        if settings.weigh_local and local_cost(decode, new_tokens, settings) <= prefill_cost(prefill, inputs):
            return aggregated(PairReason.LOCAL)
    bt = settings.block_tokens
    transfer = max(0, inputs.prompt_tokens // bt - held // bt)
    return Pair(decode, prefill, PairReason.DISAGGREGATED, new_tokens, transfer, sticky, scores)
