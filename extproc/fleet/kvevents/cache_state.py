"""The KV events as a cache-state source of the router: tokenize, match, credit, subscribe.

The router asks three things, none of which blocks its event loop for long:

- :meth:`EventCacheState.tokenized` (before the decision): for a model with a tokenizer, the
  request's prefix hashes become the engine's own block hashes over the model's tokens (or our
  content hashes in ``content`` mode), computed in a worker thread (``tokenizers`` and hashlib
  release the GIL) unless little is left to encode after what an earlier prompt shares
  (:data:`INLINE_CHARS`: then on the loop, cheaper than the hop),
  with the block size and hash algorithm the model's engines report
  (:mod:`.layout`; the configured ones until they do);
- :meth:`EventCacheState.view` (the decision's input): replicas whose feed is live get their
  matches from the event index, the others keep the estimate's;
- :meth:`EventCacheState.decided` (after it): the chosen replica gets speculative credit for the
  prompt's blocks, and its feed is expected to speak.

The decision itself stays pure: it sees an :class:`AffinityView` like any other.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from extproc.base.sampling import RateSampler
from extproc.base.world import REAL_WORLD, World
from extproc.fleet.kvevents.digests import SessionDigests
from extproc.fleet.kvevents.endpoints import rank_endpoints
from extproc.fleet.kvevents.feed import KvEventSource
from extproc.fleet.kvevents.hashing import EngineChain, HashAlgo, content_chain, low64
from extproc.fleet.kvevents.index import KvIndex
from extproc.fleet.kvevents.layout import EngineLayouts
from extproc.fleet.kvevents.observer import KvEventObserver, NullKvEventObserver
from extproc.fleet.kvevents.responses import ResponseHistory
from extproc.fleet.kvevents.settings import KvEventSettings
from extproc.fleet.kvevents.usage import PredictionStreaks, outcome
from extproc.request.agent_apis import (
    MESSAGES_PATH,
    RESPONSES_PATH,
    TRANSCRIPT_BYTES,
    messages_as_chat,
    previous_response_id,
    responses_as_chat,
)
from extproc.request.features import RequestFeatures
from extproc.request.openai_body import CHAT_PATH, COMPLETIONS_PATH
from extproc.request.tokenizer import PromptTokenizer, TokenizerError, TokenizerRegistry
from extproc.routing.model import AffinityView, Replica
from extproc.state.redis_transcripts import redis_transcripts
from extproc.state.store import AffinityStore

log = logging.getLogger("extproc.fleet.kvevents")

INLINE_CHARS = 1024
"""A chat prompt with at most this many characters left to encode (after what its session's
previous turn or a prompt of the same head shares; a completion's, after a recent one's opening)
is tokenized on the event loop: about 0.2 ms of the lab's tokenizer, less than the hop to a
worker thread and back on a loaded machine (benchmarks/configured_cost.md)."""
INLINE_TEXT_CHARS = 64 * 1024
"""And is at most this long: its blocks' hashes are computed with it (where no session's reuse)."""


class EventCacheState:
    """KV events, the index they fill, and the tokenizers that make requests comparable to it."""

    def __init__(
        self,
        settings: KvEventSettings,
        clock: Callable[[], float] = time.monotonic,
        metrics: KvEventObserver | None = None,
        tokenizers: TokenizerRegistry | None = None,
        max_blocks: int = 2048,
        hash_sessions: int = 4096,
        *,
        world: World = REAL_WORLD,
    ) -> None:
        self.settings = settings
        self.world = world  # the subscribers' reconnects wait on its time
        self.clock = clock
        self.metrics: KvEventObserver = metrics or NullKvEventObserver()
        index = KvIndex(
            default_algo=settings.hash_algo,
            max_blocks_per_replica=settings.max_blocks_per_replica,
            speculative_ttl_s=settings.speculative_ttl_s,
            weights=settings.tier_weights,
        )
        self.source = KvEventSource(index, clock, self.metrics, settings.stale_after_s)
        self.layouts = EngineLayouts(settings.block_size, settings.hash_algo, self.metrics)
        self.source.layouts = self.layouts
        self.tokenizers = tokenizers if tokenizers is not None else TokenizerRegistry(settings.tokenizers)
        self._chains: dict[HashAlgo, EngineChain] = {}
        self.streaks = PredictionStreaks(settings.stale_after_mispredictions)
        self.max_blocks = max_blocks
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.responses = ResponseHistory(hash_sessions, clock=clock)
        """The conversations the engines store under the Responses answers made through here
        (and, once :meth:`keep_responses` is given a Redis store, through the other gateways)."""
        self.digests = SessionDigests(hash_sessions, max_blocks)
        self._held_cap = hash_sessions
        # Per request just decided (by its features' identity, until its prediction is read): the
        # chosen replica and the blocks it held on any tier.
        self._held: OrderedDict[int, tuple[str, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.subscriptions: Any = None  # extproc.fleet.kvevents.subscriber.Subscriptions, made by start()
        self._members: list[Replica] = []
        self._hits: dict[str, float] = {}
        self._checks = RateSampler()  # check_sample_rate

    def _chain(self, algo: HashAlgo) -> EngineChain | None:
        if algo is HashAlgo.CONTENT:
            return None
        chain = self._chains.get(algo)
        if chain is None:
            chain = self._chains[algo] = EngineChain(algo, self.settings.hash_seed)
        return chain

    def engine_pages(self, pages: Iterable[tuple[str, int | None, str | None, Iterable[str]]]) -> None:
        """Take in what replicas' /metrics pages say of their cache layout: (replica, block_size,
        prefix_caching_hash_algo, model names) each, as last scraped."""
        changed = False
        for replica, block_size, hash_algo, models in pages:
            changed = self.layouts.from_page(replica, block_size, hash_algo, models) or changed
        if changed:
            self.source.refit()

    # -- before the decision ----------------------------------------------------------------
    async def tokenized(self, features: RequestFeatures, body: Mapping[str, Any] | None) -> RequestFeatures:
        """``features`` with prefix hashes over the model's tokens, when it has a tokenizer
        (``body``: the request's parsed body)."""
        model = self.settings.resolve(features.model)[0]
        tok = self.tokenizers.get(model)
        if tok is None or not body or features.body_error is not None or features.has_media:
            return features
        bs, algo = self.layouts.layout(model)
        if features.path == RESPONSES_PATH and (previous := previous_response_id(body)) is not None:
            # Another gateway may have routed the turn before: its conversation, from the store.
            await self.responses.fetch(previous, tenant=features.tenant, model=features.model)
        layout = (bs, self._chain(algo))
        try:
            text = self._chat_text(tok, features, body)
            left = self._left_to_encode(tok, features, body, text)
            if left is not None and left <= INLINE_CHARS:
                # Little left to encode (a follow-up, a prompt after a known system prompt): on the
                # loop, where the hop to a worker and back would cost more than the work.
                keys, tokens = self.block_keys(tok, features, body, layout, text)
            else:
                loop = asyncio.get_running_loop()
                keys, tokens = await loop.run_in_executor(
                    self._executor, self.block_keys, tok, features, body, layout, text
                )
        except Exception as exc:  # bad input gets character blocks, never a failed decision
            self.metrics.tokenize_failed()
            log.debug("not tokenized (%s): routed on character blocks", exc)
            return features
        return replace(features, prefix_hashes=keys, prompt_tokens=tokens, tokens_per_block=bs)

    @staticmethod
    def _left_to_encode(
        tok: PromptTokenizer, features: RequestFeatures, parsed: Mapping[str, Any], chat_text: str | None
    ) -> int | None:
        """What a chat's template (``chat_text``) or a completion's prompt leaves to encode after
        what earlier prompts share; None for other prompts and ones too long to hash on the loop."""
        prompt = parsed.get("prompt") if features.path.startswith(COMPLETIONS_PATH) else None
        text = chat_text if chat_text is not None else prompt
        if not isinstance(text, str) or len(text) > INLINE_TEXT_CHARS:
            return None
        return tok.unshared(text, features.session_key) if chat_text is not None else tok.plain.unshared(text)

    @staticmethod
    def _chat_text(tok: PromptTokenizer, features: RequestFeatures, parsed: Mapping[str, Any]) -> str | None:
        """A chat request's rendered template (None for the other APIs). Rendered on the loop: jinja2
        holds the GIL, so a worker thread would not free the loop while it renders."""
        if not features.path.startswith(CHAT_PATH):
            return None
        return tok.render_chat(parsed.get("messages") or [], parsed.get("tools"))

    def block_keys(
        self,
        tok: PromptTokenizer,
        features: RequestFeatures,
        parsed: Mapping[str, Any],
        layout: tuple[int, EngineChain | None],
        chat_text: str | None = None,
    ) -> tuple[tuple[int, ...], int]:
        """The request's block keys and prompt length in tokens (in a worker thread unless little
        is left to encode), in blocks of ``layout``'s size hashed by its chain (None: content
        hashes); ``chat_text``: a chat request's template already rendered."""
        if features.path.startswith(CHAT_PATH) and chat_text is not None:
            t = tok.encode(chat_text, add_special_tokens=False, session=features.session_key)
        elif features.path.startswith(CHAT_PATH):
            t = tok.chat_ids(parsed.get("messages") or [], parsed.get("tools"), session=features.session_key)
        elif features.path.startswith(COMPLETIONS_PATH):
            t = tok.completion_ids(parsed.get("prompt"))
        elif features.path in (MESSAGES_PATH, RESPONSES_PATH):
            # As vLLM renders them: the chat request each API is turned into, through the template.
            if features.path == MESSAGES_PATH:
                view = messages_as_chat(parsed, merge_inline_system=tok.merges_inline_system)
                t = tok.chat_ids(view.messages, view.tools, session=features.session_key)
            else:
                view = self._responses_view(parsed, features)
                t = tok.responses_ids(view.messages, view.tools)
        else:
            raise TokenizerError(f"no prompt on {features.path}")
        ids = t.ids
        bs, engine = layout
        lora = self.settings.resolve(features.model)[1]
        if engine is None:
            return tuple(content_chain(ids, bs, max_blocks=self.max_blocks, extra=lora or "")), len(ids)
        salt = parsed.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        digests = self.digests.digests(ids, features.session_key, lora, salt, bs, engine)
        return tuple(low64(d) for d in digests), len(ids)

    def _responses_view(self, parsed: Mapping[str, Any], features: RequestFeatures) -> Any:
        """A Responses request as the engine renders it: after the conversation stored under its
        ``previous_response_id`` where this router saw it whole; remembered under its own id."""
        previous = previous_response_id(parsed)
        history = self.responses.conversation(previous) if previous is not None else None
        if previous is not None and history is None:
            # The engine prepends a conversation not known here: no prefix of it can be hashed.
            raise TokenizerError("the conversation of previous_response_id is not known here")
        view = responses_as_chat(parsed, history or ())
        own = parsed.get("request_id")
        if isinstance(own, str) and own and parsed.get("store") is not False:
            self.responses.asked(own, view.messages, tenant=features.tenant, model=features.model)
        return view

    # -- the decision's input and after -----------------------------------------------------
    def view(self, view: AffinityView, features: RequestFeatures, members: Sequence[str], now: float) -> AffinityView:
        """Matches from the events for replicas whose feed is live; the estimate's elsewhere."""
        if not features.tokens_per_block or not features.prefix_hashes:
            return view
        live = self.source.live(members, now)
        if not live:
            return view
        model = self.settings.resolve(features.model)[0]
        from_events = self.source.holdings(model, features.prefix_hashes, live, now)
        matches = {r: n for r, n in view.prefix_matches.items() if r not in live}
        for replica, (_, weighted) in from_events.items():
            if weighted >= 1:
                matches[replica] = int(weighted)
        pinned = view.pinned
        # When the pinned replica's own events show it lost most of the conversation (evicted
        # under pressure), the pin is marked lost: it is then worth what the replica still holds
        # (at least the session scorer's floor), so the session moves only when another replica's
        # hold on this conversation outweighs the price of moving. A pin dropped outright sent
        # each next turn to wherever a shared system prompt was, and scattered conversations
        # over caches that were already full.
        # Judged on what any tier holds: a conversation its GPU evicted while CPU memory or storage
        # keeps it is loaded back there, not lost.
        held = from_events[pinned][0] if pinned in from_events else 0
        lost = view.pin_lost
        if pinned in live and held < self.settings.unpin_below * len(features.prefix_hashes):
            lost = "kv_events"
        return AffinityView(pinned=pinned, prefix_matches=matches, pin_lost=lost)

    def decided(self, features: RequestFeatures, replica: str, matched_blocks: int, now: float) -> None:
        """Credit the chosen replica and expect its feed to speak."""
        if not features.tokens_per_block:
            return
        if self.source.is_live(replica, now):
            # What it holds on any tier, before the credit below: the engine reports the blocks it
            # loads from CPU memory or storage among its cached tokens, as those it had on the GPU.
            model = self.settings.resolve(features.model)[0]
            held = self.source.holdings(model, features.prefix_hashes, [replica], now).get(replica, (0, 0.0))[0]
            matched_blocks = max(matched_blocks, held)
            with self._lock:
                self._held[id(features)] = (replica, matched_blocks)
                while len(self._held) > self._held_cap:
                    self._held.popitem(last=False)
            self.metrics.tokens_predicted(replica, matched_blocks * features.tokens_per_block)
        else:
            with self._lock:  # an object of the same identity decided earlier is not this request
                self._held.pop(id(features), None)
        if not self.source.suspended.get(replica):
            # A suspended feed's index is only checked, never used: credit would make its checked
            # predictions claim this very request's blocks.
            self.source.credit(self.settings.resolve(features.model)[0], replica, features.prefix_hashes, now)
        self.source.note_routed(replica, now)

    # -- checking predictions against response bodies ----------------------------------------
    def sample_check(self) -> bool:
        """Whether to read this request's response body for its reported cached tokens
        (``check_sample_rate``, deterministic: 0.25 is exactly every fourth request)."""
        return self._checks.take(self.settings.check_sample_rate)

    def predicted_tokens(self, features: RequestFeatures, replica: str, matched_blocks: int, now: float) -> int | None:
        """The cached tokens the index predicted on ``replica`` for this request, when its events
        answered for it (tokenized, feed live), or would have (its feed suspended for its
        predictions only: they are still checked, to know when to use it again); None when there
        is nothing to check."""
        if not features.tokens_per_block:
            return None
        if self.source.is_live(replica, now):
            with self._lock:
                held = self._held.pop(id(features), None)
            if held is not None and held[0] == replica:
                matched_blocks = max(matched_blocks, held[1])
            return matched_blocks * features.tokens_per_block
        if self.source.suspended.get(replica) == {"predictions"} and self.source.speaks(replica, now):
            model = self.settings.resolve(features.model)[0]
            blocks = self.source.holdings(model, features.prefix_hashes, [replica], now).get(replica, (0, 0.0))[0]
            return blocks * features.tokens_per_block
        return None

    def check(self, replica: str, predicted: int, reported: int | None, block_size: int) -> str:
        """Count how a prediction compared with the replica's report (``unreported`` without one);
        predictions that keep disagreeing set the replica's feed aside (:class:`PredictionStreaks`)."""
        result = "unreported" if reported is None else outcome(predicted, reported, block_size)
        self.metrics.prediction_checked(replica, result)
        suspended = "predictions" in self.source.suspended.get(replica, ())
        action = self.streaks.record(replica, result, predicted, block_size, suspended)
        if action == "suspend" and self.source.suspend(replica, "predictions"):
            log.warning(
                "kv events: %s's last %d checked predictions disagreed with the cached tokens it reported "
                "(last: predicted %d, reported %s): its feed is treated as stale, the estimate answers for it",
                replica, self.streaks.threshold, predicted, reported,
            )  # fmt: skip
        elif action == "resume" and self.source.resume(replica, "predictions"):
            log.info("kv events: %s's predictions agree again: its feed is used again", replica)
        return result

    def keep_responses(self, store: AffinityStore, ttl_s: float) -> None:
        """Keep Responses conversations for ``ttl_s`` (the sessions' TTL) and, when ``store`` is
        Redis, share them through it with every gateway of the deployment."""
        self.responses.share(redis_transcripts(store, TRANSCRIPT_BYTES), ttl_s)

    # -- subscriptions ----------------------------------------------------------------------
    def start(self, replicas: Sequence[Replica]) -> None:
        """Subscribe (needs a running loop): each replica's publisher, and ``listen`` if set."""
        from extproc.fleet.kvevents.subscriber import Subscriptions

        self.subscriptions = Subscriptions(self.source, self.settings.replay_timeout_s, self.world)
        self._members = list(replicas)
        if self.settings.listen:
            self.subscriptions.listen(self.settings.listen, self.resolve)
        self.sync(replicas)

    def sync(self, replicas: Sequence[Replica]) -> None:
        """Follow the replicas that publish, stop following those that left."""
        self._members = list(replicas)
        subs = self.subscriptions
        if subs is None:
            return
        names = set()
        for r in replicas:
            names.add(r.name)
            ranks = rank_endpoints(r, self.settings)
            for rank, (pub, replay) in enumerate(ranks):
                subs.follow(r.name, pub, replay, rank=rank)
            for rank in subs.ranks(r.name):
                if rank >= len(ranks):
                    subs.unfollow(r.name, rank)  # fewer ranks now: the index keeps what the others hold
        for name in subs.following():
            if name not in names:
                subs.unfollow(name)
        for name in list(self.source.feeds):
            if name not in names:
                self.source.remove_feed(name)
        for name in list(self.layouts.reports):
            if name not in names:
                self.layouts.forget(name)
                self.streaks.forget(name)
        self.source.refit()

    def resolve(self, who: str) -> str | None:
        """A topic's replica part (a name, an address, or a host) as a member's name."""
        for r in self._members:
            if who in (r.name, r.address, r.address.rpartition(":")[0]):
                return r.name
        return None

    def collect(self, reported_hits: Mapping[str, float | None] | None = None) -> None:
        """Refresh gauges before a scrape. ``reported_hits``: each replica's
        ``vllm:prefix_cache_hits_total`` as last scraped; its growth while the replica's feed is
        live counts as reported cached tokens, beside the tokens the index predicted."""
        self.source.collect()
        now = self.clock()
        for replica, hits in (reported_hits or {}).items():
            if hits is None:
                continue
            before = self._hits.get(replica)
            self._hits[replica] = hits
            if before is not None and hits >= before and self.source.is_live(replica, now):
                self.metrics.tokens_reported(replica, hits - before)

    async def close(self) -> None:
        """Stop the subscribers and the tokenizing threads."""
        if self.subscriptions is not None:
            await self.subscriptions.close()
        await self.responses.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
