"""What the request core asks the world to do, and the two drivers that do it.

The core (:mod:`extproc.core.request`) is written as generators that never wait and never touch a
store, a queue or a tokenizer: where a step needs the outside world it yields an *effect*, a
plain value naming what to do, and is sent back its result. A driver carries the effects out:

- :meth:`Effects.drive`, for the processor: each effect awaited on the event loop (a Redis
  round trip, a wait in the fair queue);
- :meth:`Effects.drive_now`, for the simulator and tests: each effect carried out at once,
  without an event loop. Only effects that complete without waiting may be driven so (the
  memory store's, a queue that never holds): one that would wait is refused with an error,
  never run halfway.

The failures an effect may meet are the driver's to absorb where routing goes on without it: a
store that fails a lookup answers an empty view (the decision then hashes), a record that fails
is counted and forgotten, each as :mod:`extproc.app.router` always did.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from extproc.fleet.queueing import FairQueue, Refusal, Ticket
from extproc.fleet.queueing.kv_room import Entry
from extproc.request.features import RequestFeatures
from extproc.routing.model import AffinityView
from extproc.state.budgets import Admission as BudgetAdmission
from extproc.state.budgets import BudgetLedger
from extproc.state.conversations import Conversations
from extproc.state.store import AffinityStore

if TYPE_CHECKING:  # its module loads the tokenizers: only servers with KV events pay for that
    from extproc.fleet.kvevents.cache_state import EventCacheState

log = logging.getLogger("extproc.core")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Identify:
    """Name the keyless conversation ``features`` continues (or a new one); ``peek``: Explain's, no TTL slides."""

    features: RequestFeatures
    now: float
    peek: bool = False


@dataclass(frozen=True, slots=True)
class Tokenize:
    """Hash ``features``' prompt over its model's tokens, where a tokenizer serves it."""

    features: RequestFeatures
    body: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Reserve:
    """Reserve a request's estimated tokens on its token budgets (``now``: the wall clock)."""

    tenant: str
    tokens: int
    now: float
    key_digest: str | None
    model: str


@dataclass(frozen=True, slots=True)
class Hold:
    """Wait in the fair queue until the request may go (``ready``: until its objectives may be met)."""

    request_class: str
    tenant: str
    pool: tuple[tuple[str, str], ...]
    demotion: int = 0
    ready: Callable[[], bool] | None = None


@dataclass(frozen=True, slots=True)
class Lookup:
    """Read the store's view for a request: its pin and its prefix's matches (``peek``: refreshing nothing)."""

    features: RequestFeatures
    now: float
    peek: bool = False


@dataclass(frozen=True, slots=True)
class Record:
    """Write a routed request's pin and prefix to the store, and its conversation's chain; a
    disaggregated request's prefix on its prefill replica too."""

    features: RequestFeatures
    replica: str
    now: float
    pin: bool
    prefill: str | None = None


@dataclass(frozen=True, slots=True)
class AwaitRoom:
    """Wait until one of ``among`` has KV room for a new conversation (``queueing.kv_room``):
    its claim, inside on that replica, or not inside once its time is up."""

    features: RequestFeatures
    among: frozenset[str]


Effect = Identify | Tokenize | Reserve | Hold | Lookup | Record | AwaitRoom
Steps = Generator[Effect, Any, T]
"""A step of the core: yields effects, is sent each one's result, returns its own."""


class RoomWaits(Protocol):
    """The KV room (``queueing.kv_room``) as the request path meets it."""

    def arrived(self, session: str) -> None:
        """A turn of ``session`` came, before it is decided: room kept for it waits for it."""

    async def await_any(self, features: RequestFeatures, among: frozenset[str]) -> Entry:
        """Wait until one of ``among`` has room for ``features``, a new conversation."""
        ...


class Effects:
    """Carries out the core's effects on the router's store, queue, budgets and tokenizers."""

    def __init__(
        self,
        store: AffinityStore,
        conversations: Conversations,
        store_error: Callable[[str], None],
        *,
        budgets: BudgetLedger | None = None,
        queue: FairQueue | None = None,
        kv_events: EventCacheState | None = None,
        room: RoomWaits | None = None,
    ) -> None:
        self.store = store
        self.conversations = conversations
        self.store_error = store_error
        self.budgets = budgets
        self.queue = queue
        self.kv_events = kv_events
        self.room = room

    async def drive(self, steps: Steps[T]) -> T:
        """Run ``steps`` to its result, each effect awaited."""
        result: Any = None
        while True:
            try:
                effect = steps.send(result)
            except StopIteration as stop:
                value: T = stop.value
                return value
            result = await self.carry_out(effect)

    def drive_now(self, steps: Steps[T]) -> T:
        """Run ``steps`` to its result without an event loop: each effect must complete at once."""
        result: Any = None
        while True:
            try:
                effect = steps.send(result)
            except StopIteration as stop:
                value: T = stop.value
                return value
            result = self.carry_out_now(effect)

    def carry_out_now(self, effect: Effect) -> Any:
        """One effect's result, without an event loop (as :meth:`drive_now` carries it out)."""
        return at_once(self.carry_out(effect))

    async def carry_out(self, effect: Effect) -> Any:
        """One effect's result."""
        # One dict lookup by the effect's exact type: a request carries out four to six.
        return await _CARRIERS[type(effect)](self, effect)

    async def _identify(self, effect: Identify) -> RequestFeatures:
        features = await self.conversations.identify(effect.features, effect.now, peek=effect.peek)
        if self.room is not None and not effect.peek and features.session_key is not None:
            # Its conversation is known from here: the room kept for it must not lapse while the
            # router itself decides (tokenizing, the store), which a loaded gateway makes slow.
            self.room.arrived(features.session_key)
        return features

    async def _tokenize(self, effect: Tokenize) -> RequestFeatures:
        if self.kv_events is None:
            return effect.features
        return await self.kv_events.tokenized(effect.features, effect.body)

    async def _lookup(self, effect: Lookup) -> AffinityView:
        features = effect.features
        try:
            read = self.store.peek if effect.peek else self.store.lookup
            return await read(features.session_key, features.prefix_hashes, effect.now, model=features.model)
        except Exception as exc:  # the store is an optimisation: route on hashing without it
            if not effect.peek:
                self.store_error("lookup")
            log.debug("store lookup failed: %s", exc)
            return AffinityView()

    async def _record(self, effect: Record) -> None:
        features = effect.features
        try:
            await self.store.record(
                features.session_key,
                effect.replica,
                features.prefix_hashes,
                effect.now,
                effect.pin,
                model=features.model,
            )
            await self.conversations.remember(features, effect.now)
            if effect.prefill is not None:  # it holds the prompt too once it prefilled it
                await self.store.record(
                    None, effect.prefill, features.prefix_hashes, effect.now, False, model=features.model
                )
        except Exception as exc:
            self.store_error("record")
            log.debug("store record failed: %s", exc)

    async def _reserve(self, effect: Reserve) -> BudgetAdmission:
        assert self.budgets is not None, "a reservation without budgets configured"
        return await self.budgets.admit(
            effect.tenant, effect.tokens, effect.now, key_digest=effect.key_digest, model=effect.model
        )

    async def _hold(self, effect: Hold) -> Refusal | Ticket | None:
        assert self.queue is not None, "a hold without a queue configured"
        return await self.queue.admit(effect.request_class, effect.tenant, effect.pool, effect.ready, effect.demotion)

    async def _await_room(self, effect: AwaitRoom) -> Entry:
        assert self.room is not None, "a wait for KV room without queueing.kv_room"
        return await self.room.await_any(effect.features, effect.among)


_CARRIERS: dict[type[Any], Callable[[Effects, Any], Coroutine[Any, Any, Any]]] = {
    Lookup: Effects._lookup,
    Record: Effects._record,
    Identify: Effects._identify,
    Tokenize: Effects._tokenize,
    Reserve: Effects._reserve,
    Hold: Effects._hold,
    AwaitRoom: Effects._await_room,
}
"""Each effect's handler, by its type (the effects are final: no subclass is ever yielded)."""


def at_once(coro: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that completes without waiting, run without an event loop; one
    that would wait (a Redis store's, a queue that holds) is closed and refused."""
    try:
        coro.send(None)
    except StopIteration as stop:
        result: T = stop.value
        return result
    coro.close()
    raise RuntimeError("driven without an event loop, an effect waited: use the memory store and no queue")
