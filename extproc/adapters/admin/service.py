"""The admin API's servicer: translates between its messages and the router's methods."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from extproc._proto.admin.v1 import admin_pb2 as pb
from extproc._proto.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc.adapters.admin.auth import MutationPolicy, Verdict
from extproc.adapters.admin.fleet import fleet
from extproc.adapters.telemetry import reuse_rows
from extproc.app.router import Router
from extproc.routing.latency import verdict
from extproc.routing.trace import Explanation

log = logging.getLogger("extproc.adapters.admin")


def explanation_message(ex: Explanation) -> pb.ExplainResponse:
    """An :class:`Explanation` as the API returns it."""
    d, trace, view = ex.decision, ex.trace, ex.view
    removed = trace.removed_by()
    rank = {name: i for i, name in enumerate(trace.order)}
    sources = ex.match_sources
    predicted = trace.predicted
    priced = trace.prices
    replicas = []
    for state in ex.snapshot.replicas:
        name = state.name
        evidence = ex.evidence.get(name)
        by, why = removed.get(name, ("", ""))
        parts = [
            pb.ScorePart(
                scorer=s.scorer, raw=s.raw.get(name, 0.0), weight=s.weight, contribution=s.weight * s.raw.get(name, 0.0)
            )
            for s in trace.scorers
            if name in trace.totals
        ]
        replicas.append(
            pb.ReplicaExplanation(
                replica=name,
                candidate=name in trace.totals,
                removed_by=by,
                removed_why=why,
                scores=parts,
                total=trace.totals.get(name, 0.0),
                matched_blocks=view.prefix_matches.get(name, 0),
                match_source=sources.get(name, "estimate"),
                predicted_uncached_tokens=ex.uncached_tokens.get(name, 0),
                rank=rank.get(name, -1),
                cache_trust=evidence.trust if evidence else 1.0,
                cache_evidence_age_s=-1.0
                if evidence is None or evidence.evidence_age_s is None
                else evidence.evidence_age_s,
                kv_events=evidence.kv_events if evidence else "",
                predicted_ttft_ms=_ms(predicted[name].ttft_s if name in predicted else None),
                predicted_tpot_ms=_ms(predicted[name].tpot_s if name in predicted else None),
                price_s=priced[name].total_s if name in priced else -1.0,
                price_ttft_s=priced[name].ttft_s if name in priced else -1.0,
                price_parts=[pb.PricePart(part=k, seconds=v) for k, v in priced[name].parts().items()]
                if name in priced
                else [],
                price_rates=priced[name].rates.source if name in priced else "",
            )
        )
    chosen = d.replica.name if d.replica is not None else ""
    f = ex.features
    outcome, why = verdict(f, predicted, d.objective_missed or bool(ex.on_miss))
    return pb.ExplainResponse(
        replica=chosen,
        reason=d.reason.value,
        order=trace.order,
        fallbacks=[r.name for r in d.fallbacks],
        filters=[
            pb.FilterStep(
                filter=f.filter,
                removed=[pb.RemovedReplica(replica=n, why=w) for n, w in f.removed],
                failed_open=f.failed_open,
            )
            for f in trace.filters
        ],
        replicas=replicas,
        total_blocks=d.total_blocks,
        matched_blocks=d.matched_blocks,
        predicted_uncached_tokens=ex.uncached_tokens.get(chosen, 0),
        pinned=view.pinned or "",
        key_source=trace.key_source,
        profile=trace.profile,
        model=ex.features.model,
        body_error=ex.features.body_error or "",
        moved_by=d.moved_by,
        pin_lost=view.pin_lost or "",
        objective_ttft_ms=f.slo_ttft_ms or 0.0,
        objective_tpot_ms=f.slo_tpot_ms or 0.0,
        objective_predicted=outcome,
        on_miss=ex.on_miss,
        objective_why=why if outcome else "",
        prefill=d.prefill.name if d.prefill is not None else "",
        pair_reason=d.pair.value if d.pair is not None else "",
        transfer_blocks=d.transfer_blocks,
        conversation=(f.conversation.match or "") if f.conversation is not None else "",
        session=f.session_key or "",
    )


def _ms(seconds: float | None) -> float:
    return -1.0 if seconds is None else seconds * 1000.0


async def usage_message(router: Router) -> pb.UsageResponse:
    """The router's metered tokens and its budgets' standing, as the API returns them."""
    meter, budgets = router.meter, router.budgets
    if meter is None:
        return pb.UsageResponse(enabled=False)
    standings = await budgets.standings(router.world.wall()) if budgets is not None else []
    return pb.UsageResponse(
        enabled=True,
        since=meter.started_at,
        usage=[
            pb.TenantUsage(
                tenant=row.tenant,
                model=row.model,
                input_tokens=row.input,
                cached_input_tokens=row.cached_input,
                output_tokens=row.output,
                estimated_tokens=row.estimated,
            )
            for row in meter.rows()
        ],
        budgets=[
            pb.BudgetUsage(
                kind=b.kind,
                name=b.name,
                windows=[
                    pb.BudgetWindow(
                        window=w.window, limit=w.limit, used=w.used, remaining=w.remaining, reset_s=w.reset_s
                    )
                    for w in b.windows
                ],
            )
            for b in standings
        ],
    )


class AdminService(pb_grpc.AdminServicer):
    """Explain, replicas, sessions, cordons, the decision feed and the token usage of one router."""

    def __init__(self, router: Router, policy: MutationPolicy, default_sample_rate: float = 0.1) -> None:
        self.router = router
        self.policy = policy
        self.default_sample_rate = default_sample_rate

    async def _authorise(self, context: Any, call: str) -> None:
        await self._enforce(context, call, self.policy.check(context.invocation_metadata() or ()))

    async def _may_read(self, context: Any, call: str) -> None:
        # A call made in-process (tests, the console) has no gRPC context, and so no metadata.
        metadata = (context.invocation_metadata() or ()) if context is not None else ()
        await self._enforce(context, call, self.policy.check_read(metadata))

    async def _enforce(self, context: Any, call: str, verdict: Verdict) -> None:
        if not verdict.allowed:
            log.warning("admin %s refused: %s", call, verdict.refused_because)
            code = grpc.StatusCode.UNAUTHENTICATED if verdict.unauthenticated else grpc.StatusCode.PERMISSION_DENIED
            await context.abort(code, verdict.refused_because)

    async def _known(self, context: Any, name: str) -> None:
        if name not in self.router.replicas:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no replica named {name!r}")

    async def Explain(self, request: pb.ExplainRequest, context: Any) -> pb.ExplainResponse:
        """The decision for a request, without side effects."""
        await self._may_read(context, "Explain")
        headers = {h.key.lower(): h.value for h in request.headers}
        headers.setdefault(":path", "/v1/chat/completions")
        explanation = await self.router.explain(headers, request.body or None)
        return explanation_message(explanation)

    async def ListReplicas(self, request: pb.ListReplicasRequest, context: Any) -> pb.ListReplicasResponse:
        """Every replica's state."""
        await self._may_read(context, "ListReplicas")
        return pb.ListReplicasResponse(
            replicas=[
                pb.ReplicaInfo(
                    name=r.name,
                    address=r.address,
                    health=r.health,
                    health_penalties=r.health_penalties,
                    in_rotation=r.in_rotation,
                    rotation_state=r.rotation_state,
                    cordon=r.cordon,
                    inflight=r.inflight,
                    queue=r.queue,
                    kv_usage=r.kv_usage,
                    sessions_pinned=r.sessions_pinned,
                    kv_events=r.kv_events,
                    pending_prefill_tokens=r.pending_prefill_tokens,
                    scrape_failures=r.scrape_failures,
                    cache_trust=r.cache_trust,
                    role=r.role,
                )
                for r in fleet(self.router)
            ]
        )

    async def ListHotKeys(self, request: pb.ListHotKeysRequest, context: Any) -> pb.ListHotKeysResponse:
        """The hot prefixes, by fingerprint."""
        await self._may_read(context, "ListHotKeys")
        detector = self.router.hot_keys
        if detector is None:
            return pb.ListHotKeysResponse(enabled=False)
        now = self.router.clock()
        ranked = sorted(detector.hot().values(), key=lambda h: -h.rate_rps)
        return pb.ListHotKeysResponse(
            enabled=True,
            cooling=detector.cooling,
            hot_keys=[
                pb.HotKeyInfo(
                    key=h.label,
                    requests_per_second=h.rate_rps,
                    mean_prompt_tokens=h.tokens,
                    replicas=h.replicas,
                    hot_for_s=max(0.0, now - h.since),
                    warm_ready=detector.warm_ready(h.fingerprint),
                )
                for h in ranked
            ],
        )

    async def GetUsage(self, request: pb.UsageRequest, context: Any) -> pb.UsageResponse:
        """Tokens by tenant and model since start, and the budgets as they stand."""
        await self._may_read(context, "GetUsage")
        return await usage_message(self.router)

    async def GetHitRatio(self, request: pb.HitRatioRequest, context: Any) -> pb.HitRatioResponse:
        """The hit ratio decomposed per pool and replica since start (extproc.fleet.cache.reuse)."""
        await self._may_read(context, "GetHitRatio")
        return pb.HitRatioResponse(
            since=self.router.reuse.since,
            rows=[
                pb.HitRatioRow(
                    pool=r.pool,
                    replica=r.replica,
                    prompt_blocks=r.prompt_blocks,
                    offered_blocks=r.offered_blocks,
                    captured_blocks=r.captured_blocks,
                    engine_queries_tokens=r.engine_queries_tokens,
                    engine_hits_tokens=r.engine_hits_tokens,
                )
                for r in reuse_rows(self.router)
            ],
        )

    async def GetSession(self, request: pb.SessionRequest, context: Any) -> pb.SessionReply:
        """Where the session is pinned."""
        await self._may_read(context, "GetSession")
        view = await self.router.store.peek(request.session_key, (), self.router.clock(), model=request.model)
        return pb.SessionReply(session_key=request.session_key, model=request.model, replica=view.pinned or "")

    async def ForgetSession(self, request: pb.SessionRequest, context: Any) -> pb.SessionReply:
        """Unpin the session."""
        await self._authorise(context, "ForgetSession")
        forgotten = await self.router.store.forget_session(request.session_key, model=request.model)
        return pb.SessionReply(session_key=request.session_key, model=request.model, forgotten=forgotten)

    async def _set(self, request: pb.ReplicaRequest, context: Any, call: str, state: str | None) -> pb.CordonReply:
        await self._authorise(context, call)
        await self._known(context, request.replica)
        try:
            moved = await self.router.fleet.set_cordon(request.replica, state)
        except Exception as exc:  # the shared store is away: say so rather than pretend
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the store did not take it: {exc}")
        return pb.CordonReply(
            replica=request.replica, cordon=self.router.cordons.get(request.replica, ""), sessions_moved=moved
        )

    async def Cordon(self, request: pb.ReplicaRequest, context: Any) -> pb.CordonReply:
        """No new sessions or prefixes to the replica."""
        return await self._set(request, context, "Cordon", "cordoned")

    async def Uncordon(self, request: pb.ReplicaRequest, context: Any) -> pb.CordonReply:
        """Back to normal."""
        return await self._set(request, context, "Uncordon", None)

    async def Drain(self, request: pb.ReplicaRequest, context: Any) -> pb.CordonReply:
        """Move its sessions away, then take nothing."""
        return await self._set(request, context, "Drain", "drained")

    async def WatchDecisions(self, request: pb.WatchRequest, context: Any) -> AsyncIterator[pb.DecisionEvent]:
        """Sampled decisions as they are made."""
        await self._may_read(context, "WatchDecisions")
        rate = request.sample_rate if 0 < request.sample_rate <= 1 else self.default_sample_rate
        async for s in self.router.feed.watch(rate):
            yield pb.DecisionEvent(
                time=s.time,
                replica=s.replica,
                reason=s.reason,
                model=s.model,
                matched_blocks=s.matched_blocks,
                total_blocks=s.total_blocks,
                decision_ms=s.decision_ms,
                skipped=s.skipped,
                prefill=s.prefill,
                pair_reason=s.pair_reason,
            )
