"""What a shared Redis store costs a routing decision, and what a session costs Redis in memory.

Decision latency is ``Router.route`` in-process (feature extraction from a realistic multi-turn
chat body, store lookup, the decision, the record), timed call by call, for:

- ``memory``: the embedded in-memory store (the baseline);
- ``redis``: Redis on loopback TCP, near-cache off: every decision makes its round trip, as
  when each turn of a conversation lands on a different gateway;
- ``redis, unix socket``: the same over a unix socket (a Redis beside the gateway);
- ``redis + near-cache``: the default near-cache (1 s): hot sessions skip Redis.

Requests are replayed turn by turn across all sessions, so consecutive requests belong to
different sessions. Redis memory is ``INFO memory`` ``used_memory`` before and after writing
one million session pins (keys as the store names them, 36-character session ids) with a
pipeline, and after indexing a full prefix index (``blocks_per_replica`` blocks on 4 replicas).

    .venv/bin/python benchmarks/store_latency.py [--sessions 200] [--turns 6] [--memory-sessions 1000000]

Results go to ``benchmarks/store_latency.md`` (``--out``). Everything runs on the same machine
as the Redis server; on a shared machine, run it twice and compare.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import redis

from extproc.api import (
    RECORD,
    AffinityStore,
    Config,
    KeySpace,
    MemoryStore,
    Metrics,
    RedisStore,
    Replica,
    Router,
    open_store,
    pack_hashes,
)
from extproc_lab.demo.processes import ProcessGroup
from extproc_lab.demo.redis_server import LocalRedis, redis_binary
from extproc_lab.demo.workload import multi_turn

MODEL = "demo-model"
REPLICAS = tuple(Replica(f"replica-{i}", f"10.0.0.{i + 1}:8000") for i in range(4))


@dataclass
class Result:
    name: str
    samples: list[float]
    remote: int = 0
    near: int = 0

    def pct(self, q: float) -> float:
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6


def requests(sessions: int, turns: int, seed: int) -> list[tuple[dict[str, str], bytes]]:
    """Headers and bodies, turn-major: all sessions' first turns, then all second turns, ..."""
    convs = multi_turn(sessions, turns, seed=seed, run_id=f"bench{seed}")
    out = []
    for turn in range(turns):
        for conv in convs:
            body = {"model": MODEL, "messages": conv.next_messages(turn), "max_tokens": 64}
            conv.add_answer("An answer of a few sentences about the document. " * 4)
            headers = {":method": "POST", ":path": "/v1/chat/completions", "x-session-id": conv.session_id}
            out.append((headers, json.dumps(body).encode()))
    return out


async def replay(name: str, store: AffinityStore, reqs: list[tuple[dict[str, str], bytes]], warmup: int) -> Result:
    router = Router(Config(replicas=REPLICAS, metrics=Metrics(enabled=False)), store=store)
    samples = []
    gc.collect()
    for i, (headers, body) in enumerate(reqs):
        t = time.perf_counter()
        routed = await router.route(headers, body)
        elapsed = time.perf_counter() - t
        router.release(routed)
        if i >= warmup:
            samples.append(elapsed)
        # A server yields to the event loop between requests (it reads the next one); without
        # this, near-cache hits never yield and the background writer would starve.
        await asyncio.sleep(0)
    result = Result(name, samples)
    if isinstance(store, RedisStore):
        assert await store.flush(5.0), "writes did not drain"
        result.remote, result.near = store.counters.remote_lookups, store.counters.near_hits
        assert store.available and not store.counters.errors, store.counters
    await store.close()
    return result


def used_memory(client: redis.Redis) -> int:
    info = client.info("memory")
    return int(info["used_memory"])


def session_memory(client: redis.Redis, count: int, ttl_ms: int = 600_000) -> float:
    """Bytes of Redis memory per session pin, written as the store writes them."""
    client.flushall()
    keys = KeySpace("bench")
    rng = random.Random(1)
    before = used_memory(client)
    pipe = client.pipeline(transaction=False)
    for i in range(count):
        session = str(uuid.UUID(int=rng.getrandbits(128)))
        pipe.set(keys.session(MODEL, session), f"replica-{i % 4}", px=ttl_ms)
        if i % 10_000 == 9_999:
            pipe.execute()
    pipe.execute()
    after = used_memory(client)
    assert client.dbsize() == count
    return (after - before) / count


def prefix_memory(client: redis.Redis, blocks_per_replica: int, ttl_ms: int = 600_000) -> float:
    """Bytes of Redis memory per (replica, block) entry of a full prefix index."""
    client.flushall()
    keys = KeySpace("bench")
    rng = random.Random(2)
    before = used_memory(client)
    for replica in REPLICAS:
        index = keys.prefix_index(MODEL, replica.name)
        for _ in range(blocks_per_replica // 512):
            blob = pack_hashes([rng.getrandbits(64) for _ in range(512)])
            client.eval(
                RECORD,
                3,
                index,
                keys.replicas(MODEL),
                index,
                0,
                ttl_ms,
                replica.name,
                blocks_per_replica,
                blob,
                0,
                ttl_ms // 8,
            )
    after = used_memory(client)
    return (after - before) / (len(REPLICAS) * (blocks_per_replica // 512) * 512)


async def latency(server: LocalRedis, sessions: int, turns: int) -> list[Result]:
    ttl = 600.0
    results = []
    scenarios: list[tuple[str, str | None]] = [
        ("memory", None),
        ("redis (TCP), near-cache off", f"{server.url}?near_cache_ttl=0"),
        ("redis (unix socket), near-cache off", f"{server.unix_url}?near_cache_ttl=0"),
        ("redis (TCP), near-cache 1 s (default)", server.url),
    ]
    for seed, (name, url) in enumerate(scenarios, start=1):
        reqs = requests(sessions, turns, seed)
        store = MemoryStore(ttl) if url is None else open_store(url, ttl_s=ttl, namespace=f"latency-{seed}")
        results.append(await replay(name, store, reqs, warmup=sessions))
    return results


def render(args: argparse.Namespace, results: list[Result], per_session: float, per_block: float) -> str:
    base = results[0]
    version = subprocess.run([redis_binary(), "--version"], capture_output=True, text=True, check=True).stdout
    lines = [
        "# Affinity store: decision latency and Redis memory",
        "",
        "Produced by:",
        "",
        "```",
        f".venv/bin/python benchmarks/store_latency.py --sessions {args.sessions} --turns {args.turns} "
        f"--memory-sessions {args.memory_sessions}",
        "```",
        "",
        f"Machine: {os.cpu_count()} cores shared with other work, Python {platform.python_version()}, "
        f"{version.split(' sha=')[0].strip()} on loopback, redis-py {redis.__version__} (no hiredis); "
        f"load average {os.getloadavg()[0]:.2f} when it finished.",
        "",
        f"## Decision latency (`Router.route`, {args.sessions} sessions x {args.turns} turns, first turn of each "
        "session excluded as warm-up)",
        "",
        f"Bodies are the multi-turn chat workload (`extproc_lab.demo.workload.multi_turn`): system prompt, a "
        f"1,500-token document, follow-ups; {len(base.samples)} decisions per row.",
        "",
        "| store | p50 (us) | p90 (us) | p99 (us) | mean (us) | added at p50 (us) | Redis lookups | near-cache hits |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.pct(0.5):.0f} | {r.pct(0.9):.0f} | {r.pct(0.99):.0f} | "
            f"{statistics.fmean(r.samples) * 1e6:.0f} | {r.pct(0.5) - base.pct(0.5):+.0f} | {r.remote} | {r.near} |"
        )
    lines += [
        "",
        "Reading: *near-cache off* is the cost when every turn of a conversation lands on a different "
        "gateway (one `EVALSHA` per decision; the record is written behind the decision, but its "
        "pipeline shares this process's event loop and Redis's single thread with the next lookup). "
        "*near-cache 1 s* replays the same turns within about a second of each other, as an agent's "
        "burst of calls does: only the first lookup of each session goes to Redis.",
        "",
        "## Redis memory",
        "",
        "| what | bytes each | for |",
        "|---|---:|---|",
        f"| session pin (key `ext:{{ns/model}}:s:<36-char id>`, replica name, TTL) | {per_session:.0f} | "
        f"{args.memory_sessions:,} sessions: {per_session * args.memory_sessions / 2**20:.0f} MiB |",
        f"| prefix index entry (one block on one replica, sorted-set member) | {per_block:.0f} | "
        f"{args.blocks_per_replica:,} blocks x 4 replicas: "
        f"{per_block * args.blocks_per_replica * 4 / 2**20:.1f} MiB |",
        "",
    ]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> str:
    directory = Path(tempfile.mkdtemp(prefix="extproc-bench-"))
    try:
        with ProcessGroup(directory) as procs:
            server = LocalRedis(procs, directory).start()
            results = await latency(server, args.sessions, args.turns)
            with server.client() as client:
                per_session = session_memory(client, args.memory_sessions)
                per_block = prefix_memory(client, args.blocks_per_replica)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return render(args, results, per_session, per_block)


def main() -> int:
    """Run and write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--memory-sessions", type=int, default=1_000_000)
    parser.add_argument("--blocks-per-replica", type=int, default=31_250)
    parser.add_argument("--out", default=str(Path(__file__).with_name("store_latency.md")))
    args = parser.parse_args()
    text = asyncio.run(main_async(args))
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
