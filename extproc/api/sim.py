"""What the lab needs of the router beyond :mod:`extproc.api`: a synchronous driver for the
simulator, and the pieces a model of the router's world must share with the router bit for bit.

- :class:`SyncDriver`: the one way the simulator drives a :class:`~extproc.api.Router` on a virtual
  clock, without an event loop: route a request given as features, identify a keyless
  conversation, learn of first tokens and ends, take in scrapes, change the membership, note
  sessions in the rebalancer's ledger. Every call into the router's insides the simulator needs
  is made here and nowhere else in the lab, so the router may change them in one place.
- the simulator's own pieces of the router: the pre-warmer (:class:`Prewarmer`, driven on the
  virtual clock), the admission queue (:class:`Admission`), what a peer router's policy decides
  with (:data:`Decider`, :func:`ranked_decision`, :class:`HashRing`, :class:`PrefixIndex`);
- how prompts are keyed (:func:`block_hashes`, :func:`model_seed`, :func:`conversation_chain`)
  and how vLLM keys and publishes its blocks (:class:`EngineChain`, :class:`HashAlgo`,
  :func:`low64`, :func:`seq_frame`), for workloads and the fake replica to match the router;
- the engine side of the protocols the router speaks: Anthropic Messages and OpenAI Responses
  (:mod:`agent_apis`'s views) and the prefill/decode KV transfer, for the fake replica and
  its sidecar.

As with :mod:`extproc.api`, **a name not in ``__all__`` is private and may move or change**.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from extproc.app.router import Routed, Router
from extproc.base.world import World
from extproc.config import Config
from extproc.core.effects import Identify, at_once
from extproc.core.membership import Membership
from extproc.fleet.health.replicas import LoadReport
from extproc.fleet.health.vllm_metrics import ReplicaMetrics
from extproc.fleet.kvevents.hashing import EngineChain, HashAlgo, low64
from extproc.fleet.kvevents.wire import seq_frame
from extproc.fleet.queueing import Admission, Refusal
from extproc.fleet.rebalance.prewarm import Prewarmer
from extproc.request.agent_apis import (
    MESSAGES_PATH,
    RESPONSES_PATH,
    AgentApiError,
    ChatView,
    messages_as_chat,
    previous_response_id,
    responses_as_chat,
)
from extproc.request.conversation import conversation_chain
from extproc.request.features import RequestFeatures
from extproc.request.kv_transfer import PARAMS_FIELD, PREFILLER_HEADER, answer_params, decode_body, prefill_body
from extproc.request.prefix import block_hashes, model_seed
from extproc.routing.latency import LatencyFit
from extproc.routing.model import AffinityView, Replica
from extproc.routing.pipeline import Decider, Profile, decide, ranked_decision
from extproc.routing.ring import HashRing
from extproc.state.memory import MemoryStore, PrefixIndex

if TYPE_CHECKING:  # its module loads the tokenizers: only a run with KV events pays for that
    from extproc.fleet.kvevents.cache_state import EventCacheState

__all__ = [
    "MESSAGES_PATH",
    "PARAMS_FIELD",
    "PREFILLER_HEADER",
    "RESPONSES_PATH",
    "Admission",
    "AgentApiError",
    "ChatView",
    "Decider",
    "EngineChain",
    "HashAlgo",
    "HashRing",
    "LatencyFit",
    "Membership",
    "PrefixIndex",
    "Prewarmer",
    "Refusal",
    "SyncDriver",
    "answer_params",
    "block_hashes",
    "conversation_chain",
    "decode_body",
    "low64",
    "messages_as_chat",
    "model_seed",
    "prefill_body",
    "previous_response_id",
    "ranked_decision",
    "responses_as_chat",
    "seq_frame",
]

_NO_HEADERS: dict[str, str] = {}


class SyncDriver:
    """A :class:`~extproc.api.Router` over a memory store, driven synchronously on a virtual clock.

    It is built from the router's ``config`` (its replicas are the initial membership), the
    simulator's ``clock``, and optionally the default ``profile``, a ``prewarmer`` of the
    simulator's own, the ``kv_events`` cache state the simulator feeds and a peer's ``decider``.
    Its chance is seeded (``seed``: new keyless conversations' identities, which the ring's
    tie-break follows), so that a run repeats exactly.
    The simulator calls it as the ext_proc server would call the router over a request's life:
    :meth:`identify` and :meth:`route` when it arrives, :meth:`first_token` when its first token
    passes, :meth:`finished` at its end; and as the scraper and the fleet would:
    :meth:`scrape` (or :meth:`report_load`), :meth:`evaluate`, :meth:`set_replicas`.
    """

    def __init__(
        self,
        config: Config,
        clock: Callable[[], float],
        *,
        profile: Profile | None = None,
        prewarmer: Prewarmer | None = None,
        kv_events: EventCacheState | None = None,
        decider: Decider = decide,
        seed: int = 0,
    ) -> None:
        store = MemoryStore(config.sessions.ttl_s, config.sessions.max_sessions, config.prefix.blocks_per_replica)
        self._router = Router(
            config,
            store=store,
            clock=clock,
            profile=profile,
            prewarmer=prewarmer,
            kv_events=kv_events,
            decider=decider,
            world=World(rng=random.Random(seed)),
        )
        self._effects = self._router.effects

    @property
    def profile(self) -> Profile:
        """The router's default routing profile."""
        return self._router.profile

    # --- a request's life ----------------------------------------------------------------------

    def identify(self, features: RequestFeatures, now: float) -> RequestFeatures:
        """A keyless conversation known by its messages, as the router's own entry point does:
        ``features`` with the conversation's session key."""
        named: RequestFeatures = self._effects.carry_out_now(Identify(features, now))
        return named

    def route(self, features: RequestFeatures, now: float, *, may_wait: bool = False) -> Routed:
        """Route a request given as features, arrived at ``now``: the request core's decision
        (:meth:`~extproc.core.request.RequestCore.place`), its effects carried out at once. With
        ``may_wait`` a request whose class queues on a predicted miss of its objectives comes back
        unrouted with ``objective_wait`` set, for the simulator's queue to hold."""
        return self._effects.drive_now(self._router.core.place(features, now, may_wait=may_wait))

    def first_token(self, routed: Routed, now: float) -> None:
        """The request's first token passed at ``now``: what the processor learns then, if it
        sampled the response (a 200; its tokens timed if the token-timing sample says so, since
        the headers of vLLM's streams come before the first token and tell nothing)."""
        watching, outcomes = self._router.watching, self._router.outcomes
        if watching.sample_response():
            timed = watching.times_tokens(_NO_HEADERS) and watching.sample_timing()
            outcomes.observe_response(routed, 200, timed=timed)
            outcomes.first_token(routed, now)

    def finished(self, routed: Routed, first_at: float | None, last_at: float | None, output_tokens: int) -> None:
        """The request ended: its tokens' times taken in, its slot released."""
        self._router.outcomes.tokens_over(routed, first_at, last_at, output_tokens)
        self._router.release(routed)

    def fleet_saturated(self, pool: tuple[tuple[str, str], ...]) -> bool:
        """Whether every candidate of ``pool`` is saturated (the server's test for holding)."""
        return self._router.fleet_saturated(pool)

    def objective_ready(self, features: RequestFeatures, stored: AffinityView) -> Callable[[], bool]:
        """When a request held for its objectives may go (see the router's ``objective_ready``)."""
        return self._router.core.objective_ready(features, stored)

    def offer_hot_body(self, features: RequestFeatures, body: Callable[[], bytes]) -> None:
        """Offer the body of a routed request to the hot-key warmer, if hot keys are on; ``body``
        is called only if the warmer wants it."""
        if self._router.hot_keys is not None:
            self._router.offer_hot_body(features, body)

    def note_session(self, features: RequestFeatures, replica: str, body: Callable[[], bytes], now: float) -> None:
        """A session's request routed to ``replica``, noted in the rebalancer's ledger with its body
        and the prefix hashes it was looked up by, as the router's own entry point does (when
        rebalancing is on; ``body`` is called only then)."""
        rebalancer = self._router.rebalancer
        if features.session_key is None or not rebalancer.settings.enabled:
            return
        rebalancer.note(
            features.session_key, features.model, replica, features.path, body(), now, features.prefix_hashes
        )

    # --- the fleet -----------------------------------------------------------------------------

    def scrape(self, name: str, metrics: ReplicaMetrics, at: float) -> None:
        """A scrape of replica ``name`` at ``at``, into the replica book."""
        self._router.replicas.apply_scrape(name, metrics, at)

    def report_load(self, name: str, report: LoadReport, at: float) -> None:
        """Load alone (no prefix counters) of replica ``name`` at ``at``, into the replica book."""
        self._router.replicas.apply_report(name, report, at)

    def evaluate(self, at: float) -> None:
        """The replica book's health evaluation at ``at``."""
        self._router.replicas.evaluate(at)

    def set_replicas(self, replicas: Sequence[Replica]) -> Membership:
        """Make ``replicas`` the membership: joins take their ring share of live sessions, leaves
        move theirs."""
        return at_once(self._router.fleet.set_replicas(replicas))

    def replica_count(self) -> int:
        """How many replicas the router knows."""
        return len(self._router.replicas)

    def idle(self) -> bool:
        """No request in flight and no prefill pending on any replica (the end of a clean run)."""
        return all(rec.inflight == 0 and rec.pending_prefill_tokens == 0 for rec in self._router.replicas.records())

    def scraped(self) -> bool:
        """Whether any replica's load has been scraped."""
        return any(rec.scraped_at > 0 for rec in self._router.replicas.records())

    def set_opening_weight(self, weight: float) -> None:
        """What a keyless opening's KV counts at, at least, while its first turn runs (0: at the
        return rate alone), for a sweep of it (``benchmarks/keyless_opening_weight.py``)."""
        self._router.replicas.sessions.opening_weight = weight

    def live_sessions(self, now: float) -> int:
        """Sessions live in the rebalancer's ledger at ``now``."""
        return sum(1 for _ in self._router.rebalancer.ledger.live(now))

    def sessions_moved_at(self, now: float) -> frozenset[str]:
        """The live sessions the rebalancer moved at ``now``."""
        return frozenset(e.session for e in self._router.rebalancer.ledger.live(now) if e.moved_at == now)

    # --- what the run learnt -------------------------------------------------------------------

    def reuse_blocks(self) -> tuple[int, int, int]:
        """The router's hit-ratio ledger over the run (``extproc.fleet.cache.reuse``): prefix blocks
        routed, offered (held by some replica of the pool), captured (held by the replica chosen)."""
        rows = self._router.reuse.rows()
        return (
            sum(r.prompt_blocks for r in rows),
            sum(r.offered_blocks for r in rows),
            sum(r.captured_blocks for r in rows),
        )

    def latency_fits(self) -> Mapping[str, LatencyFit]:
        """The router's latency models per replica, as last fitted."""
        return self._router.latency.view().fits
