"""What each replica's prefix cache holds, as the router knows it: one view the decision reads.

Three sources answer, each where it knows best:

- :mod:`.estimate`: the store's prefix index (the router's own decisions), bounded by each
  replica's reported cache size and weighed by its reported hits (its *trust*), on evidence only;
- :mod:`.inflight`: the prompts of the router's requests in flight there, which the replica will
  hold when a request sent now runs, however short the index's memory;
- vLLM's KV events (:mod:`extproc.fleet.kvevents`), where a replica publishes them and its feed is live:
  then its matches come from its own events.

:class:`ReplicaCaches` combines them (:meth:`ReplicaCaches.view`) for the request path and for
Explain alike, and says per replica which source answered, its trust and how fresh its evidence is.
"""

from extproc.fleet.cache.estimate import CacheEstimate
from extproc.fleet.cache.inflight import InflightPrefixes
from extproc.fleet.cache.view import CacheView, ReplicaCaches

__all__ = ["CacheEstimate", "CacheView", "InflightPrefixes", "ReplicaCaches"]
