"""The conversations vLLM stores under Responses answers, as the router keeps them: bounded and
expiring in memory, and shared through a real Redis between two routers (two gateways), so a
``previous_response_id`` turn that reaches the other router is pinned and hashed as the first
router would have; a Redis that dies costs the hashing only."""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc.app.plan import Planner
from extproc.app.router import Routed, Router
from extproc.fleet.kvevents.cache_state import EventCacheState
from extproc.fleet.kvevents.hashing import EngineChain, HashAlgo
from extproc.fleet.kvevents.responses import ResponseHistory, _encode, link, pack, unpack
from extproc.fleet.kvevents.settings import KvEventSettings
from extproc.observe.metrics import RouterMetrics
from extproc.observe.metrics.kv_events import KvEventMetrics
from extproc.request.tokenizer import PromptTokenizer, TokenizerRegistry
from extproc.routing.model import Reason
from extproc.state.factory import open_store
from extproc.state.memory import MemoryStore
from extproc.state.redis_store import RedisStore
from extproc.state.redis_transcripts import RedisTranscripts
from extproc.state.store import AffinityStore
from extproc_lab.demo.processes import ProcessGroup
from extproc_lab.demo.redis_server import LocalRedis
from tests.conftest import make_config, require_binary
from tests.helpers import BS, Clock

HEADERS = {":path": "/v1/responses"}
TTL_S = 60.0
_namespaces = itertools.count()


# -- in memory -----------------------------------------------------------------------------------


def test_a_conversation_is_known_once_answered_bounded_and_expiring() -> None:
    clock = Clock(0.0)
    history = ResponseHistory(capacity=2, clock=clock)
    history.asked("resp_1", [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}])
    assert history.conversation("resp_1") is None  # its answer not read yet
    history.answered("resp_1", [{"role": "assistant", "content": "yes"}])
    assert history.conversation("resp_1") == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "yes"}]
    history.asked("resp_2", [])
    history.asked("resp_3", [])
    assert history.conversation("resp_1") is None  # bounded: the oldest went
    # With the sessions' TTL: gone once it passed, kept until then.
    history.share(None, ttl_s=10.0)
    history.asked("resp_4", [{"role": "user", "content": "q"}])
    history.answered("resp_4", [])
    clock.now = 9.9
    assert history.conversation("resp_4") == [{"role": "user", "content": "q"}]
    clock.now = 10.0
    assert history.conversation("resp_4") is None
    history.answered("resp_4", [{"role": "assistant", "content": "late"}])  # an expired turn takes no answer
    assert history.conversation("resp_4") is None


def test_a_shared_conversation_survives_encoding_and_garbage_is_refused() -> None:
    asked = [{"role": "user", "content": "héllo \udcff"}, {"role": "tool", "content": None, "tool_call_id": "c"}]
    answer = [{"role": "assistant", "content": "x" * 10_000}]
    payload = pack(_encode(asked), _encode(answer))
    assert unpack(payload) == (asked, answer)
    assert len(payload) < 1_000  # compressed
    for bad in (b"", b"\x02" + payload[1:], payload[:-3], b"\x01\x00\x00\x00\x02{}", pack(_encode([]), b"{}")):
        with pytest.raises(ValueError):
            unpack(bad)
    assert link("a", "resp_1") != link("b", "resp_1")  # tenants never read each other's


# -- two routers sharing one Redis ---------------------------------------------------------------


def kv_state(tokenizer_dir: Path, clock: Clock) -> EventCacheState:
    return EventCacheState(
        KvEventSettings(tokenizers={"m": str(tokenizer_dir)}),
        clock=clock,
        metrics=KvEventMetrics(),
        tokenizers=TokenizerRegistry({"m": str(tokenizer_dir)}),
    )


def gateway(tokenizer_dir: Path, clock: Clock, store: AffinityStore, metrics: RouterMetrics | None = None) -> Router:
    """A router as ``extproc serve`` wires one: its KV-event state keeps Responses conversations
    with the sessions' TTL, in the store when it is Redis."""
    kv = kv_state(tokenizer_dir, clock)
    kv.keep_responses(store, TTL_S)
    return Router(make_config(), clock=clock, kv_events=kv, store=store, metrics=metrics)


def shared(router: Router) -> RedisTranscripts:
    assert router.kv_events is not None and isinstance(router.kv_events.responses.shared, RedisTranscripts)
    return router.kv_events.responses.shared


async def turn(router: Router, body: dict[str, Any], reply: str) -> Routed:
    """One Responses turn through ``router``'s planner, answered with ``reply`` (read whole)."""
    planner = Planner(router)
    watch = planner.watch(can_override=True, whole_body=True, headers=HEADERS)
    plan = await planner.plan(HEADERS, json.dumps(body).encode(), watch)
    assert plan.routed.features.response_id is not None
    assert planner.response_headers(plan, {":status": "200"})
    rid = plan.routed.features.response_id
    answer = {"id": rid, "output": [{"type": "message", "content": [{"type": "output_text", "text": reply}]}]}
    await planner.response_body(plan, json.dumps(answer).encode(), True)
    planner.end(plan)
    return plan.routed


async def settled(*routers: Router) -> None:
    """Every write behind the decisions and answers reached Redis (a client's next turn comes later)."""
    for router in routers:
        assert isinstance(router.store, RedisStore) and await router.store.flush()
        assert await shared(router).flush()


def busy(router: Router, replica: str) -> None:
    """``replica`` has prompts in flight from ``router``: a new conversation goes elsewhere."""
    for _ in range(4):
        router.replicas.begin(replica, 0.0, prefill_tokens=4096)


def engine_hashes(tokenizer_dir: Path, messages: list[dict[str, str]]) -> list[int]:
    return EngineChain(HashAlgo.SHA256).hashes(PromptTokenizer(tokenizer_dir).responses_ids(messages).ids, BS)


@pytest.fixture
async def pair(redis_server: LocalRedis, tokenizer_dir: Path) -> AsyncIterator[tuple[Router, Router]]:
    """Two gateways on one Redis and one namespace, each with its own memory of everything."""
    namespace = f"responses-{next(_namespaces)}"
    stores = [open_store(f"{redis_server.url}?near_cache_ttl=0", ttl_s=TTL_S, namespace=namespace) for _ in "ab"]
    routers = [gateway(tokenizer_dir, Clock(1000.0), s) for s in stores]
    yield routers[0], routers[1]
    for router in routers:
        assert router.kv_events is not None
        await router.kv_events.close()
        await router.store.close()


async def test_a_follow_up_at_the_other_gateway_is_pinned_and_hashed_as_at_the_first(
    pair: tuple[Router, Router], tokenizer_dir: Path, redis_server: LocalRedis
) -> None:
    a, b = pair
    first = {"model": "m", "instructions": "be brief", "input": "what is a cache?"}
    one = await turn(a, first, "A store.")
    await settled(a)
    rid = one.features.response_id
    assert rid is not None and one.decision.replica is not None
    with redis_server.client() as c:  # it is Redis that carries it, with the sessions' TTL
        key = shared(a).store.keys.transcript("m", link("", rid))
        assert 0 < c.pttl(key) <= TTL_S * 1000
    # The next turn reaches the other gateway, which never saw the first, and on its own would
    # place it elsewhere (that replica is busy there).
    busy(b, one.decision.replica.name)
    follow = {"model": "m", "instructions": "be brief", "input": "and a block?", "previous_response_id": rid}
    two = await turn(b, follow, "A run of tokens.")
    engine = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is a cache?"},
        {"role": "assistant", "content": "A store."},
        {"role": "user", "content": "and a block?"},
    ]
    assert list(two.features.prefix_hashes) == engine_hashes(tokenizer_dir, engine)
    assert two.decision.replica == one.decision.replica  # where the engine stores the conversation
    assert two.decision.reason == Reason.STICKY  # by the pin, read from Redis
    assert two.features.conversation is not None and two.features.conversation.match == "continued"
    assert shared(b).counters.fetched == 1
    # And the third back at the first gateway, which never saw the second.
    await settled(b)
    assert two.features.response_id is not None
    third = {"model": "m", "instructions": "be brief", "input": "why?"}
    third["previous_response_id"] = two.features.response_id
    three = await turn(a, third, "Reuse.")
    engine += [{"role": "assistant", "content": "A run of tokens."}, {"role": "user", "content": "why?"}]
    assert list(three.features.prefix_hashes) == engine_hashes(tokenizer_dir, engine)
    assert three.decision.replica == one.decision.replica
    # Another tenant naming the same response reads nothing of this one's.
    assert a.kv_events is not None
    assert await shared(a).fetch("m", link("other", rid)) is None


async def test_without_redis_each_gateway_knows_only_its_own_turns(tokenizer_dir: Path) -> None:
    """The control: two gateways with memory stores. The other gateway's follow-up cannot be
    hashed after the stored conversation (nor pinned: nothing is shared)."""
    clock = Clock(1000.0)
    routers = [gateway(tokenizer_dir, clock, MemoryStore(TTL_S, 1000, 1000)) for _ in "ab"]
    for router in routers:
        assert router.kv_events is not None and router.kv_events.responses.shared is None
    one = await turn(routers[0], {"model": "m", "input": "what is a cache?"}, "A store.")
    assert one.decision.replica is not None
    busy(routers[1], one.decision.replica.name)
    follow = {"model": "m", "input": "and a block?", "previous_response_id": one.features.response_id}
    two = await turn(routers[1], follow, "A run.")
    assert two.features.tokens_per_block == 0  # character blocks: the conversation is not known there
    assert two.decision.replica != one.decision.replica  # nor its pin: elsewhere (on vLLM, a 404)
    assert two.features.conversation is not None and two.features.conversation.match == "unmatched"
    same = await turn(routers[0], follow, "A run.")
    assert same.features.tokens_per_block == BS


@pytest.fixture
def own_redis() -> Iterator[LocalRedis]:
    """A redis-server of this test's own, to kill."""
    require_binary("redis-server")
    directory = Path(tempfile.mkdtemp(prefix="extproc-redis-"))
    with ProcessGroup(directory) as procs:
        yield LocalRedis(procs, directory).start()
    shutil.rmtree(directory, ignore_errors=True)


async def test_a_dead_redis_costs_the_hashing_only_and_its_errors_are_counted(
    own_redis: LocalRedis, tokenizer_dir: Path
) -> None:
    metrics = [RouterMetrics(), RouterMetrics()]
    url = f"{own_redis.url}?near_cache_ttl=0"
    stores = [open_store(url, ttl_s=TTL_S, namespace="dead", observer=m) for m in metrics]
    a, b = (gateway(tokenizer_dir, Clock(1000.0), s, m) for s, m in zip(stores, metrics, strict=True))
    try:
        one = await turn(a, {"model": "m", "input": "what is a cache?"}, "A store.")
        await settled(a)
        own_redis.kill()
        follow = {"model": "m", "input": "and a block?", "previous_response_id": one.features.response_id}
        two = await turn(b, follow, "A run.")
        assert two.decision.replica is not None and two.refusal is None  # routed all the same
        assert two.features.tokens_per_block == 0  # predicted without the conversation
        errors = metrics[1].registry.get_sample_value
        assert (errors("extproc_store_errors_total", {"operation": "lookup"}) or 0) + (
            errors("extproc_store_errors_total", {"operation": "transcript"}) or 0
        ) >= 1
        assert errors("extproc_store_available") == 0
        # In the outage nothing more is tried: a new turn's conversation is not written (dropped
        # and counted, never raised), and is still kept in memory for its own gateway's next turn.
        assert not shared(b).usable
        new = await turn(b, {"model": "m", "input": "a new task"}, "ok")
        assert shared(b).counters.dropped == 1 and shared(b).counters.written == 0
        assert b.kv_events is not None and new.features.response_id is not None
        assert b.kv_events.responses.conversation(new.features.response_id) is not None
        # A turn the first gateway made meanwhile is hashed there from its own memory.
        again = await turn(a, follow, "A run.")
        assert again.features.tokens_per_block == BS
    finally:
        for router in (a, b):
            assert router.kv_events is not None
            await router.kv_events.close()
            await router.store.close()


async def test_a_transcript_over_the_bound_is_not_shared(pair: tuple[Router, Router]) -> None:
    a, b = pair
    shared(a).max_bytes = shared(b).max_bytes = 2_000
    text = " ".join(f"w{i}" for i in range(5_000))  # compresses to well over 2,000 bytes
    one = await turn(a, {"model": "m", "input": text}, "ok")
    await settled(a)
    assert shared(a).counters.written == 0
    assert one.decision.replica is not None
    busy(b, one.decision.replica.name)
    follow = {"model": "m", "input": "next", "previous_response_id": one.features.response_id}
    two = await turn(b, follow, "ok")
    assert two.features.tokens_per_block == 0 and shared(b).counters.missed == 1
    assert two.decision.replica == one.decision.replica  # the pin is shared all the same
