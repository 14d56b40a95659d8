"""Redis key names of the affinity state, namespaced per deployment and per model.

Every key of one (deployment, model) pair carries the same hash tag, ``{namespace/model}``, so
in a Redis Cluster they all live in one slot. That is what lets one server-side script read a
session's pin *and* search the model's prefix index in a single round trip (a script may only
touch keys of one slot). A model's whole state then sits on one shard: a decision costs that
shard one script call, and a shard does tens of thousands of those a second, far above the
request rate of the GPUs behind one model; several models spread over the shards.

Keys (``T`` is the tag)::

    ext:{T}:s:<session key>   string   the replica the session is pinned to (sliding TTL)
    ext:{T}:c:<chain, hex>    string   the conversation (hex) a request whose messages hashed to
                                       this chain belonged to (sliding TTL, as a pin)
    ext:{T}:t:<link, hex>     string   a Responses API conversation as vLLM stores it under one
                                       response id (compressed; sessions' TTL, not sliding)
    ext:{T}:r                 zset     replica -> when it was last routed to (ms): who to search
    ext:{T}:p:<replica>       zset     8-byte block hash -> when last routed there (ms), bounded
    ext:{namespace}:models    set      models seen, so forget_replica can find every index
    ext:{namespace}:cordons   hash     replica -> "cordoned" or "drained" (an operator's; no TTL)
"""

from __future__ import annotations

from urllib.parse import quote

PREFIX = "ext:"


def _tag_part(text: str) -> str:
    # Braces would end the hash tag early and '/' separates namespace from model: escape them.
    return quote(text, safe="-._~:@!$&'()*+,;=")


class KeySpace:
    """Key names for one deployment namespace."""

    def __init__(self, namespace: str) -> None:
        if not namespace:
            raise ValueError("namespace: expected a non-empty string")
        self.namespace = namespace
        self.models_key = f"{PREFIX}{{{_tag_part(namespace)}}}:models"
        self.cordons_key = f"{PREFIX}{{{_tag_part(namespace)}}}:cordons"
        self._tags: dict[str, str] = {}

    def tag(self, model: str) -> str:
        """``ext:{namespace/model}:``, the prefix of every key of ``model``."""
        tag = self._tags.get(model)
        if tag is None:
            if len(self._tags) > 4096:  # model names come from requests: keep the memo bounded
                self._tags.clear()
            tag = self._tags[model] = f"{PREFIX}{{{_tag_part(self.namespace)}/{_tag_part(model)}}}:"
        return tag

    def session(self, model: str, session_key: str) -> str:
        """The pin of one session."""
        return f"{self.tag(model)}s:{session_key}"

    def conversation(self, model: str, chain: int) -> str:
        """The conversation of the request whose message chain ended with ``chain``."""
        return f"{self.tag(model)}c:{chain:016x}"

    def transcript(self, model: str, link: str) -> str:
        """The conversation stored under one response (``link``: its tenant's and id's digest)."""
        return f"{self.tag(model)}t:{link}"

    def replicas(self, model: str) -> str:
        """The registry of replicas with a prefix index for ``model``."""
        return f"{self.tag(model)}r"

    def prefix_base(self, model: str) -> str:
        """The prefix-index key of a replica is this plus the replica's name."""
        return f"{self.tag(model)}p:"

    def prefix_index(self, model: str, replica: str) -> str:
        """One replica's prefix index for ``model``."""
        return f"{self.prefix_base(model)}{replica}"
