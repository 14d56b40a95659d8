"""A hot prefix through real Envoy, the processor and fake replicas: spread over k replicas that
each then hit it in their cache, and gathered back on one replica when the load stops."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
K = 3
# One replica prefills 30,000 tokens/s here: the load (over 100 hot requests/s of ~900 tokens)
# needs the cap, K; the sequential requests after it (under 30/s) need one.
ROUTER_YAML = f"""\
hot_keys:
  enabled: true
  sample_rate: 1.0
  window_s: 1.0
  min_samples: 4
  max_replicas: {K}
  replica_prefill_tokens_per_s: 30000
  linger_windows: 30
"""
HOT = "You are the support agent of a large shop; answer politely and cite the policy. " * 45
OTHERS = [f"Assistant {g} of a small team, answering questions about topic {g}. " * 45 for g in range(20)]


async def ask(http: aiohttp.ClientSession, url: str, system: str, question: str) -> tuple[int, str, int]:
    body = {
        "model": "demo-model",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 2,
    }
    async with http.post(url + CHAT, json=body) as resp:
        data = await resp.json(content_type=None) if resp.status == 200 else {}
        cached = ((data.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return resp.status, resp.headers.get("x-replica-name", ""), int(cached)


async def test_a_hot_prefix_spreads_over_k_replicas_then_returns_to_one(tmp_path: Path) -> None:
    require_binary("envoy")
    gw = LocalGateway(replicas=5, time_scale=0.05, log_dir=tmp_path)
    (tmp_path / "router.yaml").write_text(ROUTER_YAML)
    gw.processor_args = ("--config", str(tmp_path / "router.yaml"))
    loop = asyncio.get_running_loop()
    hot_seen: list[tuple[float, str, int]] = []  # (time, replica, cached tokens) of hot requests
    errors: list[int] = []

    async def client(http: aiohttp.ClientSession, seed: int, until: float) -> None:
        rng = random.Random(seed)
        n = 0
        while loop.time() < until:
            n += 1
            hot = rng.random() < 0.5  # half the traffic: 20 times any other prompt's share
            system = HOT if hot else rng.choice(OTHERS)
            status, replica, cached = await ask(http, gw.url, system, f"client {seed} question {n}")
            if status != 200:
                errors.append(status)
            elif hot:
                hot_seen.append((loop.time(), replica, cached))

    with gw:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            start = loop.time()
            await asyncio.gather(*(client(http, s, start + 5.0) for s in range(8)))
            assert errors == []
            # Hot after two 1-s windows: the last two seconds are spread over its k replicas (with
            # hot keys off, today's default sent every one of them to one replica in this run).
            late = [(r, c) for t, r, c in hot_seen if t >= start + 3.0]
            spread = Counter(r for r, _ in late)
            assert len(spread) == K, spread
            assert min(spread.values()) >= 3, spread  # each takes a share (the least loaded of the k)
            hits = Counter(r for r, c in late if c > 0)
            assert set(hits) == set(spread), (spread, hits)  # each holds the prefix: its cache hits

            # The load stops: after two windows without it the prefix cools, and keeps one replica.
            await asyncio.sleep(3.5)
            after = [await ask(http, gw.url, HOT, f"after {i}") for i in range(6)]
            assert all(s == 200 for s, _, _ in after)
            replicas = {r for _, r, _ in after}
            assert len(replicas) == 1 and replicas <= set(spread), (replicas, spread)
            assert all(c > 0 for _, _, c in after)  # where the prefix is cached
            print(f"hot: {dict(spread)} ({len(late)} requests in the last 2 s); after: {replicas.pop()}")
