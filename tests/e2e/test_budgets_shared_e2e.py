"""One token budget enforced by two gateways on one Redis, through real Envoy: two gateways (each
its own Envoy and processor, the same fake replicas) share a tenant's per-day budget in one real
redis-server. A concurrent burst split across both overshoots the budget by no more than the
requests in flight can add (the figure is printed), after which either gateway refuses the tenant
with 429 and ``Retry-After`` while another tenant is served on both. With the redis-server killed
(by its PID) both gateways keep answering on their own counts: a tenant spent in Redis but not on
either gateway alone is served again, and a fresh tenant is refused once one gateway's own count
is spent, never unlimited and never refusing everyone."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from extproc.config import Config
from extproc.request.features import extract_features
from extproc.request.usage import parse_usage
from extproc.state.budgets import TokenWeights
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.load import read_metrics
from extproc_lab.demo.processes import free_port
from extproc_lab.demo.redis_server import LocalRedis
from tests.conftest import require_binary
from tests.helpers import as_tenant, tenant_api_keys

pytestmark = pytest.mark.e2e
NAMESPACE = "budgets-shared"
CHAT = "/v1/chat/completions"
WEIGHTS = TokenWeights()  # the config's: the ledger weighs usage with these

BURST_LIMIT = 4000.0  # weighted tokens a day: a day's window, so no minute rolls over mid-test
SPLIT_LIMIT = 600.0
OUTAGE_LIMIT = 400.0
HELD = ("vllm:num_requests_running", "vllm:num_requests_waiting{")  # the replicas' gauges of requests held
WORKERS = 40  # all in flight at once when the burst starts, half on each gateway
PER_WORKER = 6  # requests each worker sends at most: the burst asks for far more than the budget
TENANTS = {
    "burst": {"per_day": BURST_LIMIT},
    "split": {"per_day": SPLIT_LIMIT},
    "outage": {"per_day": OUTAGE_LIMIT},
    "bystander": {"per_day": 10**7},
}


@dataclass
class Pair:
    """Two gateways on one Redis and the same replicas."""

    gateways: tuple[LocalGateway, LocalGateway]
    redis: LocalRedis

    def budget_used(self, tenant: str) -> float:
        """What Redis holds for ``tenant``'s day window (0 before any charge)."""
        with self.redis.client() as c:
            keys = list(c.scan_iter(match=f"{{budget:{NAMESPACE}:{tenant}}}:day:*"))
            assert len(keys) <= 1, keys
            return float(c.get(keys[0]) or 0.0) if keys else 0.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    require_binary("envoy")
    require_binary("redis-server")
    config = Path(tmp_path_factory.mktemp("budgets-shared")) / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {"budgets": {"enabled": True, "tenants": TENANTS}, "tenants": {"api_keys": tenant_api_keys(*TENANTS)}}
        )
    )
    redis_port = free_port()
    args = ("--config", str(config), "--store", f"redis://127.0.0.1:{redis_port}?namespace={NAMESPACE}")
    first = LocalGateway(replicas=2, processor_args=args)
    second = LocalGateway(replicas=2, processor_args=args)
    second.members = first.members  # the same replicas behind both gateways
    redis = LocalRedis(first.procs, first.dir, port=redis_port)
    try:
        redis.start()
        first.start()
        second.start_processor()
        second.start_envoy()
        yield Pair((first, second), redis)
    finally:
        second.stop()
        first.stop()  # Redis and the replicas are in the first gateway's process group


async def clear_of_day_boundary(margin_s: float = 90.0) -> None:
    """Wait out a UTC midnight closer than ``margin_s``: the day's window must not reset mid-test."""
    left = 86_400 - time.time() % 86_400
    if left < margin_s:
        await asyncio.sleep(left + 1)  # real time: the budgets' day windows follow the wall clock


def chat(tenant: str, label: str) -> dict[str, Any]:
    # A prefix of its own, so that no prompt is found cached and every request weighs about the same.
    text = f"{label} for {tenant}: " + "tell me about token budgets " * 5
    return {"model": "demo-model", "messages": [{"role": "user", "content": text}], "max_tokens": 4}


@dataclass
class Answer:
    status: int
    tokens: float  # weighted as the ledger weighs them (0 for a refusal)
    headers: dict[str, str] = field(default_factory=dict)
    error: str = ""


async def post(http: aiohttp.ClientSession, gw: LocalGateway, tenant: str, label: str) -> Answer:
    headers = {**as_tenant(tenant), "x-session-id": f"{tenant}-{label}"}
    async with http.post(gw.url + CHAT, json=chat(tenant, label), headers=headers) as resp:
        raw = await resp.read()
        if resp.status != 200:
            error = json.loads(raw)["error"]["type"] if resp.status == 429 else raw[:200].decode()
            return Answer(resp.status, 0.0, dict(resp.headers), error)
        return Answer(200, WEIGHTS.total(parse_usage(json.loads(raw)["usage"])), dict(resp.headers))


async def spend(http: aiohttp.ClientSession, gw: LocalGateway, tenant: str, limit: float) -> list[Answer]:
    """Requests of ``tenant`` one after another until one is refused (failing if none is)."""
    answers: list[Answer] = []
    for i in range(int(limit // 10)):
        answers.append(await post(http, gw, tenant, f"seq-{gw.envoy_port}-{i}"))
        if answers[-1].status != 200:
            return answers
    pytest.fail(f"{tenant} was never refused: {answers}")


def assert_refused(answer: Answer, limit: float) -> None:
    assert answer.status == 429 and answer.error == "tokens_exceeded", answer
    assert int(answer.headers["Retry-After"]) >= 1, answer.headers
    assert answer.headers["x-ratelimit-limit-tokens"] == str(int(limit)), answer.headers


async def test_a_burst_through_two_gateways_overshoots_one_budget_by_at_most_the_requests_in_flight(
    pair: Pair,
) -> None:
    await clear_of_day_boundary()
    gateways = pair.gateways
    admitted: list[tuple[int, float]] = []  # (gateway, weighted tokens) of each admitted request
    refused: list[Answer] = []
    peak = 0  # requests the replicas held at once (running or waiting), as their /metrics said
    start, done = asyncio.Event(), asyncio.Event()

    async def watch_replicas(http: aiohttp.ClientSession) -> None:
        nonlocal peak
        urls = [f"http://{m.address}/metrics" for m in gateways[0].members]
        while not done.is_set():
            held = 0
            for url in urls:
                samples = await read_metrics(http, url)
                held += sum(v for k, v in samples.items() if k.startswith(HELD))
            peak = max(peak, int(held))
            await asyncio.sleep(0.002)  # real time: sampling real gateways' metrics while streams run

    async def worker(http: aiohttp.ClientSession, index: int) -> None:
        side = index % 2
        await start.wait()
        for j in range(PER_WORKER):
            answer = await post(http, gateways[side], "burst", f"w{index}-{j}")
            if answer.status != 200:
                refused.append(answer)
                return
            admitted.append((side, answer.tokens))

    connector = aiohttp.TCPConnector(limit=WORKERS)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
        tasks = [asyncio.create_task(worker(http, i)) for i in range(WORKERS)]
        async with aiohttp.ClientSession() as probe:
            watcher = asyncio.create_task(watch_replicas(probe))
            await asyncio.sleep(0)  # every worker waits at the start line
            start.set()
            await asyncio.gather(*tasks)
            done.set()
            await watcher

        charged = sum(tokens for _, tokens in admitted)
        largest = max(tokens for _, tokens in admitted)
        per_gateway = [sum(t for s, t in admitted if s == side) for side in (0, 1)]
        overshoot = charged - BURST_LIMIT
        # The design's bound: a gateway sees the other's requests only once they are charged (the
        # other's half of the burst in flight, each up to the largest), and reserves for its own
        # only their prompt's estimate (their output, unreserved, on top). The estimate is the
        # router's own, of this very prompt.
        settings = Config().features
        body = json.dumps(chat("burst", "w0-0")).encode()  # the shortest label: the smallest estimate
        estimate = extract_features({":path": CHAT}, body, settings).estimated_prompt_tokens * WEIGHTS.input
        bound = (WORKERS // 2) * largest + WORKERS * max(0.0, largest - estimate)
        print(
            f"\nshared budget burst: {len(admitted)} admitted, {len(refused)} refused, "
            f"the replicas held {peak} at once; "
            f"charged {charged:.0f} of {BURST_LIMIT:.0f} weighted tokens (gateways {per_gateway[0]:.0f} + "
            f"{per_gateway[1]:.0f}): overshoot {overshoot:.0f} = {overshoot / largest:.1f} requests of "
            f"{largest:.0f}, bound {bound:.0f}"
        )
        # The burst was in flight at once where it counts: the replicas held many of its requests
        # together (a burst sent one at a time could not overshoot at all).
        assert peak >= WORKERS // 2, peak
        assert all(a.status == 429 for a in refused), refused  # refused for the budget, nothing failed
        for answer in refused:
            assert_refused(answer, BURST_LIMIT)
        # What the responses reported is what Redis counts: the one budget both gateways charge.
        assert pair.budget_used("burst") == pytest.approx(charged)
        # Spent, and by no more than the requests in flight can add: each gateway reserves for its
        # own requests in flight and sees the other's only once they are charged.
        assert charged >= BURST_LIMIT - largest, (charged, largest)
        assert overshoot <= bound, (overshoot, bound)
        # At least one gateway has room left on its own count, so what refuses the tenant on it
        # below is the shared one.
        assert min(per_gateway) < BURST_LIMIT - largest, per_gateway

        # Spent for either gateway; another tenant is served by both.
        for side, gw in enumerate(gateways):
            assert_refused(await post(http, gw, "burst", f"after-{side}"), BURST_LIMIT)
            assert (await post(http, gw, "bystander", f"after-{side}")).status == 200


async def test_with_redis_killed_each_gateway_limits_on_its_own_counts(pair: Pair) -> None:
    await clear_of_day_boundary()
    first, second = pair.gateways
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        # "split" spends its budget half through each gateway: refused on both, on the shared count.
        own = [0.0, 0.0]
        for i in range(int(SPLIT_LIMIT // 10)):
            side = i % 2
            answer = await post(http, pair.gateways[side], "split", f"alternate-{i}")
            if answer.status != 200:
                break
            own[side] += answer.tokens
        else:
            pytest.fail("split was never refused")
        assert_refused(answer, SPLIT_LIMIT)
        assert_refused(await post(http, pair.gateways[1 - side], "split", "other-side"), SPLIT_LIMIT)
        assert sum(own) == pytest.approx(pair.budget_used("split"))
        per_request = sum(own) / i  # the requests weigh about the same
        assert max(own) + 2 * per_request < SPLIT_LIMIT, own  # room left on each gateway's own count

        pair.redis.kill()  # SIGKILL by its PID: gone at once, as in a crash
        try:
            for side, gw in enumerate(pair.gateways):
                # Each gateway's own count has room for "split" again: degraded, not unlimited...
                assert (await post(http, gw, "split", f"outage-{side}")).status == 200
                assert (await post(http, gw, "bystander", f"outage-{side}")).status == 200
            # ...and a fresh tenant is refused on each once that gateway's own count is spent.
            for gw in (first, second):
                answers = await spend(http, gw, "outage", OUTAGE_LIMIT)
                served = [a.tokens for a in answers if a.status == 200]
                print(
                    f"redis down: gateway :{gw.envoy_port} served {len(served)} requests ({sum(served):.0f} "
                    f"weighted tokens) of a {OUTAGE_LIMIT:.0f} budget on its own count, then refused"
                )
                assert_refused(answers[-1], OUTAGE_LIMIT)
                assert served and OUTAGE_LIMIT - max(served) <= sum(served) <= OUTAGE_LIMIT + max(served), served
                assert (await post(http, gw, "bystander", f"spent-{gw.envoy_port}")).status == 200
        finally:
            pair.redis.start()  # on its port again, empty, for whatever runs after
