"""What the price (:mod:`extproc.routing.price`) is computed with: its weights, margins and
expected sizes, and which of a replica's rates it trusts (learnt where plausible, else the
pool's prior)."""

from __future__ import annotations

from dataclasses import dataclass

from extproc.base.engine_rates import BUILT_IN_SOURCE, prior_for
from extproc.routing.model import WAITING_REQUEST_TOKENS, ReplicaState
from extproc.routing.plugins import CycleState
from extproc.routing.price_parts import Rates
from extproc.routing.rates import as_rates, fit_rates


@dataclass(slots=True)
class PriceSettings:
    """What the price is computed with (see :mod:`extproc.routing.price`).

    The rates' prior is not set here: it is each pool's ``health.engine_rates`` entry, read by
    the rate learner too (:meth:`prior`).
    """

    output_tokens: int = 256
    """A request's expected output when neither an agent's estimate nor a ``max_tokens`` up to
    ``max_output_tokens`` says, until its model's answers have been seen (then their mean:
    :mod:`extproc.fleet.health.output_lengths`)."""
    max_output_tokens: int = 4096
    """The largest ``max_tokens`` taken as the output a request expects. Up to it, the price reads
    ``max_tokens`` so (benchmarks and traces set it to the answer's length: the Mooncake traces'
    answers are at most 2,000 tokens, and expecting 256 for every one of them instead raised the
    price's TTFT p99 on mooncake-synthetic from 5.42 to 5.93 s); beyond it, it is a cap that says
    nothing of the answer (priced as an expectation, a unary request with ``max_tokens: 1000000``
    cost its pinned replica's batch a million decode steps and left it). Where chat answers end
    well before a ``max_tokens`` under it, this still overprices their decode."""
    others_weight: float = 0.05
    """The weight of the running batch's stall (``others``). At 0.1 a batch of 60 long-output
    streams made a cold 7,000-token prefill cost six times its own time, and prompts queued on
    the replica holding their prefix (shared-prefix TTFT p99 0.644 s against the default
    profile's 0.560 s); at 0.05, 0.582 s; at 0.03 the overloaded shared-prefix row at 12,000
    blocks lost its tail (p99 54 s against 33 s)."""
    session_tokens: int = 512
    turn_tokens: int = 512
    """The new part of a turn: what a session's pinned replica is assumed to lack at most while
    nothing says it lost the conversation (the index may have forgotten it; the replica has not)."""
    evict_weight: float = 1.0
    """The share of what its uncached tokens displace that later requests are expected to
    recompute (added to ``others``, in the prefill's seconds): 1, all of it once. Without it
    (0) the price took the Mooncake trace's requests off the replicas holding their prefix
    for any shorter queue, 24% hit ratio against the default profile's 33%; with 1, 29%."""
    working_set_weight: float = 0.0
    """The weight, for a request with a session, of what its place is expected to make its own next
    turns and those of the conversations due back there recompute
    (:func:`~extproc.routing.model.working_set_overflow`), at the replica's prefill rate, added
    to ``future``. 0 (off) by default; ``benchmarks/realstack-vllm.md`` has what 1 does."""
    hysteresis: float = 0.25
    prefix_hysteresis: float = 0.5
    """For a request without a session: the share of its price on the replica holding most of its
    prompt that another replica must save before the request copies the prefix there, times that
    replica's cache fill (:attr:`~extproc.routing.model.ReplicaState.cache_fill`: a copy into a
    cache with room displaces nothing). Without it the
    price chased shorter queues off the holders of Mooncake's long prefixes (hit ratio 26% against
    the default profile's 33%); with 0.5, 33.8% and TTFT p99 5.42 s against 5.98 s."""
    hysteresis_s: float = 0.01
    decode_s_per_kv_token: float = 6e-8
    """What each token of running context adds to a step (its KV read): ``llama-8b-h100``'s 128 KiB
    a token at ~2.2 TB/s. A step of 60 running requests at 8k tokens of context reads ~30 ms of KV,
    three times its fixed cost, and the prompt's prefill chunks wait through every such step."""
    chunk_tokens: int = 2048
    """The tokens one engine step computes (vLLM's ``--max-num-batched-tokens``): a prompt's prefill
    takes its tokens over this less the running batch, in steps that each pay that batch's decode
    step too. 0: prefill at the rate alone."""
    waiting_tokens: int = WAITING_REQUEST_TOKENS
    """The prompt tokens each request the engine reports waiting (``vllm:num_requests_waiting``) is
    assumed to bring to its queue, where those requests are more than what the router sent there
    and has not seen answered (other gateways, other clients). A replica whose engine reports 50
    requests waiting was priced as idle without it."""
    adapter_load_s: float = 0.3
    """The seconds a replica takes to load a LoRA adapter it does not hold in a slot (vLLM reads
    it from disk, or its CPU cache, into the accelerator before the request's first step). Not
    measured here: an estimate for an adapter of tens of megabytes read from local disk; set it
    to what loading takes on the fleet. Without it the price saw nothing between a replica
    holding the adapter and one with a free slot, and half of an adapter's turns went to the
    other."""
    learned_within: float = 4.0
    """A learned rate more than this factor off its prior is taken for a fit's artefact."""
    slower_than_built_in: float = 100.0
    """Where a replica's prior is the built-in one (no pool prior was calibrated for it), how much
    slower than it a learned rate may be and still be taken. The built-in prior is an H100's, and
    slower hardware is the common case (vLLM's CPU engines here prefill 1,300-3,100 tokens/s,
    under a quarter of it): bounded at ``learned_within`` both ways, their learned rates were
    refused and they were priced as H100s. Faster than the built-in by more than
    ``learned_within`` is still an artefact."""

    def __post_init__(self) -> None:
        if (
            min(
                self.others_weight,
                self.hysteresis,
                self.prefix_hysteresis,
                self.hysteresis_s,
                self.evict_weight,
                self.decode_s_per_kv_token,
                self.adapter_load_s,
            )
            < 0
            or min(self.output_tokens, self.max_output_tokens) < 1
        ):
            raise ValueError("weights and margins must not be negative, output_tokens and max_output_tokens at least 1")
        if (
            min(self.session_tokens, self.turn_tokens, self.waiting_tokens) < 0
            or min(self.learned_within, self.slower_than_built_in) < 1
        ):
            raise ValueError(
                "session_tokens, turn_tokens and waiting_tokens must not be negative,"
                " learned_within and slower_than_built_in at least 1"
            )

    def prior(self, cycle: CycleState, state: ReplicaState) -> Rates:
        """The prior rates of ``state``: its pool's (the first ``health.engine_rates`` entry its
        labels match), else the built-in one."""
        priors = cycle.latency.priors if cycle.latency is not None else ()
        return as_rates(*prior_for(priors, state.replica.labels))

    def _plausible(self, learned: float | None, prior: float, slower: float) -> bool:
        """Whether ``learned`` is within ``learned_within`` of ``prior`` on the faster side and
        ``slower`` on the slower one, for a rate that is larger when faster."""
        return learned is not None and learned > 0.0 and prior / slower <= learned <= prior * self.learned_within

    def rates(self, cycle: CycleState, state: ReplicaState) -> Rates:
        """``state``'s rates: what was learned of it, where plausible, else its prior."""
        prior = self.prior(cycle, state)
        view = cycle.latency
        if view is None:
            return prior
        learned = view.rates.get(state.name)
        if learned is None:
            fit = view.fits.get(state.name)
            if fit is None:
                return prior
            learned = fit_rates(fit)
        prefill = learned.prefill_tokens_per_s
        decode = learned.decode_s_per_token
        per_seq = learned.decode_s_per_seq
        took = False
        overhead = prior.overhead_s
        slower = self.slower_than_built_in if prior.source == BUILT_IN_SOURCE else self.learned_within
        if self._plausible(prefill, prior.prefill_tokens_per_s, slower):
            took = True
            # The intercept learnt with that slope, where it was (a warm fit's is not an overhead).
            overhead = learned.overhead_s if learned.overhead_s is not None else overhead
        else:
            prefill = prior.prefill_tokens_per_s
        # A decode step is larger when slower: its inverse, a step rate, is bounded as the prefill's.
        steps_per_s = 1.0 / decode if decode is not None and decode > 0.0 else None
        if self._plausible(steps_per_s, 1.0 / prior.decode_s_per_token, slower):
            took = True
        else:
            decode = prior.decode_s_per_token
        # A per-sequence cost may well be near zero on a large accelerator: it is only bounded above.
        if per_seq is not None and 0.0 <= per_seq <= max(prior.decode_s_per_seq, 1e-6) * slower:
            took = True
        else:
            per_seq = prior.decode_s_per_seq
        assert prefill is not None and decode is not None and per_seq is not None
        return Rates(prefill, decode, per_seq, "learned" if took else prior.source, overhead)
