"""Explain: the decision the request path would make for a request now, with its trace, and
without side effects (nothing is pinned, counted, indexed or refreshed)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from extproc.core.effects import Identify, Lookup, Steps
from extproc.core.request import RequestCore
from extproc.request.features import read_request, uncached_tokens, with_chain
from extproc.routing.model import AffinityView
from extproc.routing.trace import DecisionTrace, Explanation


def explain(core: RequestCore, headers: Mapping[str, str], body: bytes | None) -> Steps[Explanation]:
    """What :meth:`RequestCore.route` would decide for this request now, read-only."""
    p = core.p
    now = p.clock()
    request = with_chain(read_request(headers, body, p.config.features, hashed=False), p.config.features)
    features = yield Identify(request.features, now, peek=True)
    features = yield from core.hashed(features, request)  # as route() hashes them (a memo, no state)
    stored: AffinityView = yield Lookup(features, now, peek=True)
    given, cached = core.inputs(features, stored, now, explain=True)
    given, _ = core.room_marked(replace(given, record=False))
    if p.hot_keys is not None:
        given = replace(given, hot=p.hot_keys.table())
    trace = DecisionTrace()
    decision = p.decide(given, trace)
    block_chars = p.config.features.block_chars
    names = [s.name for s in given.snapshot.replicas]
    uncached = {n: uncached_tokens(features, given.view.prefix_matches.get(n, 0), block_chars) for n in names}
    evidence = p.caches.evidence(names, now)
    on_miss = core.verdict.on_miss(features) if core.verdict.misses(features, decision) else ""
    return Explanation(
        features,
        decision,
        trace,
        given.view,
        given.snapshot,
        uncached,
        dict(p.cordons()),
        cached.sources,
        evidence,
        on_miss=on_miss,
    )
