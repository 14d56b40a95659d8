"""The price's cache ledger (``CacheFill``) follows the fleet: a replica that leaves is forgotten."""

from __future__ import annotations

from extproc.app.router import Router
from extproc.routing import Replica
from extproc.routing.price import PricePicker
from extproc.routing.registry import PRICE_PROFILE
from tests.conftest import chat_body, make_config


async def test_a_replica_that_leaves_is_forgotten_by_every_price_picker() -> None:
    replicas = (Replica("r0", "10.0.0.1:80"), Replica("r1", "10.0.0.2:80"))
    config = make_config(replicas=replicas, profile=PRICE_PROFILE).model_copy(
        update={"profiles": {"batch": make_config(profile=PRICE_PROFILE).profile}}
    )
    router = Router(config)
    pickers = [p.picker for p in router.profiles]
    assert len(pickers) == 2 and all(isinstance(p, PricePicker) for p in pickers)
    routed = await router.route({":path": "/v1/chat/completions", "x-session-id": "s"}, chat_body("a prompt " * 200))
    router.release(routed)
    chosen = routed.decision.replica.name  # type: ignore[union-attr]
    default, named = pickers
    assert isinstance(default, PricePicker) and isinstance(named, PricePicker)
    named.fill.wrote(chosen, 100)
    assert chosen in default.fill._written and chosen in named.fill._written

    await router.fleet.set_replicas([r for r in replicas if r.name != chosen])
    assert chosen not in default.fill._written and chosen not in named.fill._written
