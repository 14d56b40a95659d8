"""What routing on vLLM's KV events costs: the decision with tokenization, events decoded per
second, memory per indexed block.

- **Decision with tokenization**: ``Router.route`` in-process on a chat body of about 8 KB and
  200 KB, with a tokenizer (prompt tokenized in the worker thread, vLLM's sha256 block hashes,
  event index matches) against the same router without one (character blocks), for a session's
  first turn and for a follow-up (the same conversation plus a short turn: incremental
  tokenizing and hashing). Median and p99 over ``--runs`` decisions, each with a fresh session.
  The tokenizer is a byte-level BPE trained here (1,000 tokens: about one token per word of the
  text used), so token counts are higher than a real model's on the same text.
- **Events decoded per second**: payloads as vLLM 0.33 publishes them (maps; ``--hashes-per-event``
  blocks per ``BlockStored``, 16 tokens each, plus a ``BlockRemoved`` per 4 events), decoded, and
  decoded then applied to the index, on one core; a block event is one hash.
- **Memory per indexed block**: ``tracemalloc`` before and after indexing ``--blocks`` blocks
  (engine hashes) spread over 8 replicas, per (hash, replica) entry and per distinct hash.

    .venv/bin/python benchmarks/kv_events.py [--runs 200] [--blocks 200000]

Results go to ``benchmarks/kv_events.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from extproc.api import (
    BlockRemoved,
    BlockStored,
    Config,
    EventCacheState,
    KvEventSettings,
    Metrics,
    ModelIndex,
    Replica,
    Router,
    decode_batch,
    encode_batch,
)
from extproc_lab.replica.tokenizer_dir import build_tokenizer_dir, sample_text

MODEL = "m"


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def conversation(kbytes: int, seed: int) -> list[dict[str, str]]:
    words = kbytes * 1024 // 5
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": sample_text(words, seed)},
    ]


async def decision_cost(tok_dir: Path, kbytes: int, runs: int) -> dict[str, dict[str, float]]:
    replicas = tuple(Replica(f"r{i}", f"10.0.0.{i}:8000") for i in range(8))
    cfg = Config(replicas=replicas, metrics=Metrics(enabled=False))
    kv = EventCacheState(KvEventSettings(tokenizers={MODEL: str(tok_dir)}))
    with_tok = Router(cfg, kv_events=kv)
    without = Router(cfg)
    for r in replicas:  # every feed live, so the event index answers
        kv.source.apply_events(r.name, ())
    out: dict[str, dict[str, float]] = {}
    convs = [conversation(kbytes, seed) for seed in range(runs)]
    for label, router in (("characters", without), ("tokenized", with_tok)):
        for turn in ("first turn", "follow-up"):
            times = []
            for i, first in enumerate(convs):
                msgs = first
                if turn == "follow-up":
                    msgs = [*first, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "And then?"}]
                headers = {":path": "/v1/chat/completions", "x-session-id": f"{label}-{i}"}
                body = json.dumps({"model": MODEL, "messages": msgs}).encode()
                start = time.perf_counter()
                routed = await router.route(headers, body)
                times.append(time.perf_counter() - start)
                router.release(routed)
            out[f"{label}, {turn}"] = {
                "p50_ms": statistics.median(times) * 1000,
                "p99_ms": _pct(times, 0.99) * 1000,
                "blocks": float(len(routed.features.prefix_hashes)),
            }
    await kv.close()
    return out


def decode_rate(hashes_per_event: int, seconds: float) -> dict[str, float]:
    rng = random.Random(1)
    payloads = []
    for b in range(200):
        events: list[BlockStored | BlockRemoved] = []
        for e in range(16):
            hashes = tuple(rng.getrandbits(64) for _ in range(hashes_per_event))
            tokens = [rng.randrange(50_000) for _ in range(16 * hashes_per_event)]
            events.append(BlockStored(hashes, rng.getrandbits(64) if e else None, tokens, 16))
            if e % 4 == 3:
                events.append(BlockRemoved(hashes[:hashes_per_event]))
        payloads.append(encode_batch(float(b), events))
    blocks_per_pass = sum(len(ev.block_hashes) for p in payloads for ev in decode_batch(p).events)
    out = {}
    for label, apply in (("decode", False), ("decode + index", True)):
        index = ModelIndex(max_blocks_per_replica=10**9)
        n = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            for p in payloads:
                batch = decode_batch(p)
                if apply:
                    index.apply("r0", batch.events)
            n += blocks_per_pass
        elapsed = time.perf_counter() - start
        out[label] = n / elapsed
    out["payload_bytes_per_block"] = sum(len(p) for p in payloads) / blocks_per_pass
    return out


def memory_per_block(blocks: int, replicas: int = 8) -> dict[str, float]:
    rng = random.Random(2)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = ModelIndex(max_blocks_per_replica=10**9)
    # About a third of the blocks are shared by two replicas (a system prompt, a moved session).
    hashes = [rng.getrandbits(64) for _ in range(blocks)]
    entries = 0
    for i, h in enumerate(hashes):
        index.apply(f"r{i % replicas}", [BlockStored((h,), None, (), 16)])
        entries += 1
        if i % 3 == 0:
            index.apply(f"r{(i + 1) % replicas}", [BlockStored((h,), None, (), 16)])
            entries += 1
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return {"bytes_per_entry": used / entries, "bytes_per_hash": used / len(index), "entries": float(entries)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=200_000)
    ap.add_argument("--hashes-per-event", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".md")))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvbench-") as d:
        tok = build_tokenizer_dir(d)
        cost = {
            kb: asyncio.run(decision_cost(tok, kb, args.runs if kb < 100 else max(20, args.runs // 10)))
            for kb in (8, 200)
        }
    rate = decode_rate(args.hashes_per_event, args.seconds)
    mem = memory_per_block(args.blocks)
    lines = [
        "# KV events: decision cost, decoding rate, memory",
        "",
        f"`{' '.join(['.venv/bin/python', 'benchmarks/kv_events.py', *sys.argv[1:]])}` on {platform.machine()},"
        f" {os.cpu_count()} cores, Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}"
        " (a shared machine: other work was running).",
        "",
        "## Routing decision with tokenization (`Router.route`, 8 replicas, every feed live)",
        "",
        "| prompt | router | p50 ms | p99 ms | blocks |",
        "|---|---|---:|---:|---:|",
    ]
    for kb, rows in cost.items():
        for label, f in rows.items():
            lines.append(f"| {kb} KB | {label} | {f['p50_ms']:.2f} | {f['p99_ms']:.2f} | {f['blocks']:.0f} |")
    lines += [
        "",
        "Character blocks are 64 characters; token blocks 16 tokens of the test tokenizer (about one",
        "token per word here, so more blocks than a real model's tokenizer would make).",
        "",
        f"## Events decoded on one core ({args.hashes_per_event} blocks per `BlockStored`, vLLM 0.33 maps)",
        "",
        "| step | block events/s |",
        "|---|---:|",
        f"| decode | {rate['decode']:,.0f} |",
        f"| decode + index | {rate['decode + index']:,.0f} |",
        "",
        f"Payload: {rate['payload_bytes_per_block']:.0f} bytes per block (hash, 16 token ids, its share of the map).",
        "",
        f"## Memory per indexed block ({args.blocks:,} hashes over 8 replicas, a third held twice)",
        "",
        f"- {mem['bytes_per_entry']:.0f} bytes per (hash, replica) entry,"
        f" {mem['bytes_per_hash']:.0f} bytes per distinct hash ({mem['entries']:,.0f} entries), engine-hash mode;",
        "  content mode adds one dict entry per (engine hash, replica) for removals.",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
