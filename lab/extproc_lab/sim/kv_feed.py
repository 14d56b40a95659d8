"""The ``kv_events`` policy's source in the simulator: each replica model's stores and evictions,
delivered to the router's event index after a delay (default 50 ms, a publisher's batching and
the network), as vLLM's KV events would be.

The router then runs as it does with a tokenizer: the request's prefix hashes are the replica's
own block keys, its length in tokens is known, and replicas' matches come from the events.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

from extproc.api import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventCacheState,
    KvEventSettings,
    RequestFeatures,
    TokenizerRegistry,
)
from extproc_lab.replica.model import ReplicaModel
from extproc_lab.sim.workload import SimRequest

DEFAULT_DELAY_S = 0.05


class _Listener:
    """One replica pool's listener: timestamps each change for delivery."""

    def __init__(self, feed: SimKvFeed, replica: str) -> None:
        self.feed = feed
        self.replica = replica

    def stored(self, key: int) -> None:
        self.feed.queue(self.replica, BlockStored((key,), None, (), 1))

    def evicted(self, key: int) -> None:
        self.feed.queue(self.replica, BlockRemoved((key,)))

    def cleared(self) -> None:
        self.feed.queue(self.replica, AllBlocksCleared())


class SimKvFeed:
    """Replica models -> delayed events -> the router's :class:`EventCacheState`."""

    def __init__(
        self,
        names: Sequence[str],
        models: Sequence[ReplicaModel],
        clock: Callable[[], float],
        delay_s: float = DEFAULT_DELAY_S,
        settings: KvEventSettings | None = None,
    ) -> None:
        self.clock = clock
        self.delay_s = delay_s
        self.state = EventCacheState(settings or KvEventSettings(), clock=clock, tokenizers=TokenizerRegistry({}))
        self._pending: deque[tuple[float, str, Event]] = deque()
        for name, model in zip(names, models, strict=True):
            model.pool.listener = _Listener(self, name)
            self.state.source.apply_events(name, ())  # subscribed from the start

    def queue(self, replica: str, event: Event) -> None:
        """A change on ``replica`` now, seen by the router ``delay_s`` later."""
        self._pending.append((self.clock() + self.delay_s, replica, event))

    def deliver(self, now: float) -> None:
        """Apply every change due by ``now``, in order, a replica's consecutive ones as one batch."""
        pending = self._pending
        source = self.state.source
        while pending and pending[0][0] <= now:
            _, replica, event = pending.popleft()
            batch = [event]
            while pending and pending[0][0] <= now and pending[0][1] == replica:
                batch.append(pending.popleft()[2])
            source.apply_events(replica, batch)

    def features(self, features: RequestFeatures, request: SimRequest, max_blocks: int) -> RequestFeatures:
        """What the router computes with the model's tokenizer: the replica's own block keys."""
        return replace(
            features,
            prefix_hashes=tuple(request.keys[:max_blocks]),
            prompt_tokens=request.prompt_tokens,
            tokens_per_block=request.key_span,
        )
