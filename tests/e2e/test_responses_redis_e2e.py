"""Responses API chains through real Envoy and two processors sharing a real Redis, over fake
replicas that serve the Responses API as vLLM does with its store on (a ``previous_response_id``
anywhere but where it was made is a 404) and publish KV events in the engine's key space.

Envoy spreads ext_proc streams over the two processors, so a chain's turns alternate between
them: a follow-up often reaches the processor that never saw the turn before. Through Redis it
still finds its replica (the pin) and is hashed after the conversation the replica stores (the
transcript), so the processor's prediction of its cached tokens is checked against what the
replica reports, and agrees, on every turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.redis_server import LocalRedis
from extproc_lab.replica import REPLICA_HEADER
from extproc_lab.replica.agent_apis import STORE_ENV
from extproc_lab.replica.tokenizer_dir import build_tokenizer_dir, sample_text
from tests.conftest import require_binary
from tests.helpers import decisions, metrics_page, scrape_total, wait_for

pytestmark = pytest.mark.e2e
MODEL = "demo-model"
REPLICAS = ("replica-0", "replica-1", "replica-2")
NAMESPACE = "responses-e2e"
CHAINS, TURNS = 6, 4
# The conversation is written to Redis as the answer's last byte goes to Envoy, the pin at the
# decision: an agent's next turn comes after its tool ran, not within that write's round trip.
THINK_S = 0.3


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalGateway, LocalRedis]]:
    require_binary("envoy")
    require_binary("redis-server")
    tok = build_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    sockets = tmp_path_factory.mktemp("kv")
    labels, replica_args = {}, {}
    for name in REPLICAS:
        pub, replay = f"ipc://{sockets}/{name}.pub", f"ipc://{sockets}/{name}.replay"
        labels[name] = {"kv_events": pub, "kv_replay": replay}
        replica_args[name] = ("--tokenizer", str(tok), "--kv-events", pub, "--kv-replay", replay)
    gw = LocalGateway(replicas=len(REPLICAS), time_scale=0.02, processors=2, labels=labels, replica_args=replica_args)
    redis = LocalRedis(gw.procs, gw.dir)
    # Every answer is read for its cached tokens, to check the processor's prediction.
    store = f"{redis.url}?namespace={NAMESPACE}&connect_timeout=0.5&socket_timeout=0.5"
    gw.processor_args = ("--tokenizer", f"{MODEL}={tok}", "--kv-check-sample-rate", "1", "--store", store)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(STORE_ENV, "1")  # the fake replicas keep answers, as vLLM with the store on
        try:
            redis.start()
            gw.start()
            yield gw, redis
        finally:
            gw.stop()  # Redis is in the gateway's process group: stopped by its PID


async def _checks(http: aiohttp.ClientSession, gw: LocalGateway) -> dict[str, float]:
    """The processors' checked predictions by outcome, summed over both."""
    pages = [await metrics_page(http, url) for url in gw.metrics_urls]
    return {
        o: sum(scrape_total(p, "extproc_kv_prediction_checks_total", outcome=o) for p in pages)
        for o in ("agree", "over", "under", "unreported")
    }


async def test_a_chain_alternating_processors_is_pinned_and_predicted_on_every_turn(
    gateway: tuple[LocalGateway, LocalRedis],
) -> None:
    gw, redis = gateway
    async with aiohttp.ClientSession() as http:
        before = await decisions(http, gw.metrics_urls)
        checked = await _checks(http, gw)

        async def chain(i: int) -> tuple[set[str], list[int]]:
            seen, cached, previous = set(), [], None
            for turn in range(TURNS):
                # Each agent its own long instructions: the chains spread over the replicas.
                body: dict[str, Any] = {"model": MODEL, "instructions": sample_text(150, 1000 + i)}
                body.update(input=f"step {turn}: " + sample_text(30, 100 * i + turn), max_output_tokens=8)
                if previous is not None:
                    body["previous_response_id"] = previous
                async with http.post(gw.url + "/v1/responses", json=body) as resp:
                    assert resp.status == 200, (i, turn, resp.status, await resp.text())
                    seen.add(resp.headers[REPLICA_HEADER])
                    answer = await resp.json()
                previous = answer["id"]
                cached.append(answer["usage"]["input_tokens_details"]["cached_tokens"])
                await asyncio.sleep(THINK_S)  # real time: the agent's tool runs
            return seen, cached

        results = await asyncio.gather(*(chain(i) for i in range(CHAINS)))
        total = CHAINS * TURNS

        async def all_checked() -> bool:
            now = await _checks(http, gw)
            return sum(now.values()) - sum(checked.values()) >= total

        await wait_for(all_checked, "every answer checked", within_s=10.0)
        outcomes = {k: v - checked[k] for k, v in (await _checks(http, gw)).items()}
        after = await decisions(http, gw.metrics_urls)
    # Every turn reached the one replica that stores its chain (elsewhere a 404).
    assert all(len(seen) == 1 for seen, _ in results), results
    # Follow-ups reuse the conversation's cache, and the processors predicted each of them: the
    # ones another processor had routed the turn before of too (unhashed, they would go unchecked).
    assert all(all(c > 0 for c in cached[1:]) for _, cached in results), results
    assert outcomes == {"agree": total, "over": 0, "under": 0, "unreported": 0}, (outcomes, results)
    per_processor = [sum((after[i] - before[i]).values()) for i in range(2)]
    assert min(per_processor) >= total // 4, per_processor  # both processors routed turns
    with redis.client() as c:  # carried by Redis: a conversation a turn
        transcripts = list(c.scan_iter(match=f"ext:{{{NAMESPACE}/*}}:t:*", count=1000))
    assert len(transcripts) == total, len(transcripts)
