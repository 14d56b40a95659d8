"""The processor's own request path in process, without gRPC: one ext_proc stream a request.

    .venv/bin/python benchmarks/request_path_inprocess.py                # the cost, best of rounds
    .venv/bin/python benchmarks/request_path_inprocess.py --profile      # and where it goes (cProfile)
    py-spy record -r 400 -f raw -o /tmp/path.txt -- .venv/bin/python benchmarks/request_path_inprocess.py --rounds 6
    .venv/bin/python benchmarks/request_path_inprocess.py --spy-summary /tmp/path.txt    # the same, sampled

What ``extproc bench overhead`` sends the processor, played through :class:`RequestStream` (the
planner, the router) with the messages parsed from bytes and the answers serialized, as gRPC would:
the request headers (a new ``x-session-id`` each), an 8 KB chat body (130 blocks of prefix) and the
response headers, on two replicas with the default configuration (metrics counted, nothing served).
Reports the processor's CPU time per request, the best of ``--rounds`` rounds (a shared machine's
other load only ever adds). Not counted: gRPC's transport and Envoy's side (``extproc bench overhead``).
With ``PYTHONPATH`` on another checkout it measures that one's path.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.api import Config, Planner, Replica, RequestStream, Router
from extproc_lab.bench.overhead import chat_body

ROOT = str(Path(__file__).resolve().parent.parent) + "/"
# Where cProfile's own time of a function is charged, by its file (the first marker that matches).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "metrics (prometheus_client)",
        ("prometheus_client/", "extproc/observe/metrics.py", "extproc/adapters/telemetry.py"),
    ),
    ("body parsing (orjson, the OpenAI body)", ("orjson", "extproc/request/openai_body.py")),
    ("prefix hashing", ("extproc/request/prefix.py", "xxhash", "extproc/fleet/kvevents/hashing.py")),
    ("the decision (routing/)", ("extproc/routing/",)),
    (
        "cache view and bookkeeping",
        ("extproc/fleet/cache/", "extproc/core/bookkeeping.py", "extproc/fleet/health/", "extproc/state/"),
    ),
    ("sessions", ("extproc/sessions", "extproc/session")),
    ("features (other request/ work)", ("extproc/request/",)),
    ("the facade and plan (router.py, plan.py)", ("extproc/app/router.py", "extproc/app/plan.py")),
    ("the ext_proc stream (server/)", ("extproc/adapters/server/",)),
    ("protobuf (parse, serialize, build)", ("google/protobuf", "_pb2", "{method 'SerializeToString'", "FromString")),
    ("asyncio", ("asyncio/",)),
)


def _headers(headers: dict[str, str], response: bool = False) -> bytes:
    hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    msg = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv))
    req = pb.ProcessingRequest(response_headers=msg) if response else pb.ProcessingRequest(request_headers=msg)
    data: bytes = req.SerializeToString()
    return data


def wire(i: int, body: bytes) -> list[bytes]:
    """One request's three messages, serialized as Envoy sends them."""
    head = {":authority": "gw", ":path": "/v1/chat/completions", ":method": "POST", ":scheme": "http",
            "content-type": "application/json", "content-length": str(len(body)), "x-session-id": f"s{i}"}  # fmt: skip
    return [
        _headers(head),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)).SerializeToString(),
        _headers({":status": "200", "content-type": "application/json"}, response=True),
    ]


async def play(planner: Planner, messages: list[bytes]) -> None:
    """One request's stream: each message parsed, each answer serialized."""

    async def source() -> AsyncIterator[pb.ProcessingRequest]:
        for data in messages:
            yield pb.ProcessingRequest.FromString(data)

    async for answer in RequestStream(planner).run(source()):
        answer.SerializeToString()


async def run(requests: int, rounds: int, prompt_kb: int, profiler: cProfile.Profile | None) -> list[float]:
    """Seconds of CPU per request, one figure a round (a new router each round)."""
    body = chat_body(prompt_kb * 1024)
    out = []
    for r in range(rounds):
        router = Router(Config(replicas=tuple(Replica(f"r{i}", f"127.0.0.1:{8100 + i}") for i in range(2))))
        planner = Planner(router)
        wires = [wire(r * requests + i, body) for i in range(requests)]
        for w in wires[:50]:  # warm up
            await play(planner, w)
        if profiler is not None:
            profiler.enable()
        started = time.process_time()
        for w in wires[50:]:
            await play(planner, w)
        out.append((time.process_time() - started) / (len(wires) - 50))
        if profiler is not None:
            profiler.disable()
    return out


def category(file: str, name: str) -> str:
    where = f"{file} {name}"
    for label, markers in CATEGORIES:
        if any(m in where for m in markers):
            return label
    return "other"


def summary(profiler: cProfile.Profile, top: int) -> str:
    """Own time by category, then the functions with the most own time (cProfile's overhead
    inflates every call alike: read shares, not absolute figures)."""
    stats = pstats.Stats(profiler)
    own: Counter[str] = Counter()
    rows = []
    for (file, line, name), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        own[category(file, name)] += tottime
        short = file.rsplit("site-packages/", 1)[-1].removeprefix(ROOT)
        rows.append((tottime, f"{name} ({short}:{line})"))
    total = sum(own.values()) or 1.0
    lines = ["| where (own time) | share |", "|---|---|"]
    lines += [f"| {label} | {t / total:.1%} |" for label, t in own.most_common()]
    lines += ["", f"| the {top} functions with the most own time | share |", "|---|---|"]
    lines += [f"| `{where}` | {t / total:.1%} |" for t, where in sorted(rows, reverse=True)[:top]]
    return "\n".join(lines)


def spy_summary(path: Path, top: int) -> str:
    """Own and inclusive shares from a py-spy raw file (``-f raw``) of this benchmark, over the
    samples inside a request (under :func:`play`). Sampling adds nothing to the calls it sees,
    which cProfile inflates (a cheap call costs it as much as a dear one)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not any(f.startswith("play ") for f in frames):
            continue
        n = int(count)
        total += n
        # A frame reads "function (file:line)": charged by its file, as cProfile's rows are.
        name, _, where = frames[-1].partition(" (")
        own[category(where, name)] += n
        for frame in {f.rsplit(":", 1)[0].removeprefix(ROOT).replace(ROOT, "") for f in frames}:
            inclusive[frame] += n
    total = total or 1
    lines = ["| where (own time, sampled) | share |", "|---|---|"]
    lines += [f"| {label} | {n / total:.1%} |" for label, n in own.most_common()]
    lines += ["", f"| the {top} frames with the most time in them (inclusive) | share |", "|---|---|"]
    rows = [
        (n, f)
        for f, n in inclusive.items()
        if not f.startswith(("<module>", "main ", "run ", "Runner", "Base", "Handle"))
    ]
    lines += [f"| `{f})` | {n / total:.1%} |" for n, f in sorted(rows, reverse=True)[:top]]
    return "\n".join(lines)


def main() -> None:
    """Parse the arguments and print the figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-kb", type=int, default=8)
    p.add_argument("--profile", action="store_true", help="also print where the time goes (cProfile)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--spy-summary", type=Path, help="summarise this py-spy raw file of the benchmark instead")
    args = p.parse_args()
    if args.spy_summary is not None:
        print(spy_summary(args.spy_summary, args.top))
        return
    profiler = cProfile.Profile() if args.profile else None
    figures = asyncio.run(run(args.requests, args.rounds, args.prompt_kb, profiler))
    print(
        f"{args.prompt_kb} KB prompt, a new session each, 2 replicas: best {min(figures) * 1e6:.0f} us/request "
        f"(rounds: {', '.join(f'{f * 1e6:.0f}' for f in figures)})"
        + (" under cProfile" if profiler is not None else "")
    )
    if profiler is not None:
        print()
        print(summary(profiler, args.top))


if __name__ == "__main__":
    main()
