"""What the prefill/decode pair adds to a decision, in process: ``Router.route`` (and the pure
``decide`` under it) on the same 8 replicas, without roles and with 2 prefill + 6 decode replicas.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/disagg_decision_cost.py`` (results in
benchmarks/disaggregation.md). Each routed request is released at once (its bookkeeping undone),
so the fleet stays idle; every prompt (about 1,000 tokens) new, 64 sessions in turn, and
``disaggregation.weigh_local`` as configured by default (the hop weighed against prefilling on the
decode replica) or off (``WEIGH_LOCAL=0``: every long prompt hops, so the hop's bookkeeping is
paid too). The best of ``ROUNDS`` rounds of ``N`` requests (environment variables), to keep other
load on a shared machine out.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from extproc.api import (
    ROLE_LABEL,
    AffinityView,
    Config,
    DecisionInputs,
    Disaggregation,
    Metrics,
    Replica,
    Router,
    decide,
    read_request,
)

ROUNDS, N = int(os.environ.get("ROUNDS", "5")), int(os.environ.get("N", "2000"))
WEIGH_LOCAL = os.environ.get("WEIGH_LOCAL", "1") != "0"
SESSIONS = 64


def fleet(roles: bool) -> tuple[Replica, ...]:
    """8 replicas; with ``roles`` the first two prefill, the others decode."""
    out = []
    for i in range(8):
        labels = {ROLE_LABEL: "prefill" if i < 2 else "decode"} if roles else {}
        out.append(Replica(f"r{i}", f"127.0.0.1:{9000 + i}", labels=labels))
    return tuple(out)


def requests(count: int, tag: str = "") -> list[tuple[dict[str, str], bytes]]:
    """Headers and body of ``count`` requests, each a prompt of about 1,000 tokens of its own (no
    replica holds it: the pair is weighed on every one), over ``SESSIONS`` sessions in turn."""
    out = []
    for i in range(count):
        text = f"{tag} request {i}: " + "a long document to summarise, sentence after sentence. " * 72
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 16})
        out.append(({":path": "/v1/chat/completions", "x-session-id": f"s{i % SESSIONS}"}, body.encode()))
    return out


async def route_cost(roles: bool) -> tuple[float, dict[str, int]]:
    """Best µs per ``Router.route`` + release, and the pair outcomes seen."""
    config = Config(
        replicas=fleet(roles), metrics=Metrics(enabled=False), disaggregation=Disaggregation(weigh_local=WEIGH_LOCAL)
    )
    router = Router(config)
    outcomes: dict[str, int] = {}
    best = float("inf")
    for r in range(ROUNDS):
        reqs = requests(N, f"round {r}")
        start = time.perf_counter()
        for headers, body in reqs:
            routed = await router.route(headers, body)
            router.release(routed)
            pair = routed.decision.pair
            outcomes[pair.value if pair else "none"] = outcomes.get(pair.value if pair else "none", 0) + 1
        best = min(best, time.perf_counter() - start)
    return best / N * 1e6, outcomes


def decide_cost(roles: bool) -> float:
    """Best µs per pure ``decide`` on the same inputs (no store, no bookkeeping)."""
    config = Config(
        replicas=fleet(roles), metrics=Metrics(enabled=False), disaggregation=Disaggregation(weigh_local=WEIGH_LOCAL)
    )
    router = Router(config)
    headers, body = requests(1)[0]
    features = read_request(headers, body, config.features).features
    given, _ = router.core.inputs(features, AffinityView(), 0.0)
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(N):
            decide(DecisionInputs.of(features, given.snapshot, given.view, 0.0, given.profile, pairing=given.pairing))
        best = min(best, time.perf_counter() - start)
    return best / N * 1e6


def main() -> None:
    print(f"8 replicas, weigh_local={WEIGH_LOCAL}, best of {ROUNDS} rounds of {N}")
    for roles in (False, True):
        label = "2 prefill + 6 decode" if roles else "no roles"
        route_us, outcomes = asyncio.run(route_cost(roles))
        print(f"{label:22s} Router.route {route_us:7.1f} us   decide {decide_cost(roles):6.1f} us   pairs {outcomes}")


if __name__ == "__main__":
    main()
