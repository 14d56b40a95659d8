"""How well the price predicts a real engine's time to first token under load.

Concurrent streaming clients through a running gateway. Each client asks the admin API's Explain
for its request, sends it and waits for its headers while holding a lock (so no other request is
decided between Explain's decision and the router's), then reads its stream while the next client
goes. Which replica the router chose is read from its decision feed, in the order the requests
were decided, so a row whose Explain and decision disagree can be left out.

One procedure for the real-vLLM test (``tests/e2e/test_vllm_timing_e2e.py``, a few dozen requests)
and the benchmark that measures the figure (``benchmarks/price_accuracy.py``, several runs of more).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from extproc.api import admin_pb2 as pb
from extproc.api import admin_pb2_grpc as pb_grpc

CHAT = "/v1/chat/completions"
JSON = "application/json"


def cold_prompt(tag: int, words: int = 250) -> list[dict[str, str]]:
    """A user message no cache holds any of (it starts with the time): with ``tag`` under 10, about
    5.5 tokens a word, so 250 words are about 1,400 tokens."""
    text = f"request {tag} {time.time_ns()}: " + " ".join(f"w{tag}x{j}" for j in range(words))
    return [{"role": "user", "content": text}]


@dataclass(frozen=True)
class Row:
    """One counted request: what Explain predicted for the replica it chose, what the client saw."""

    index: int
    """Its place in the order the router decided requests (the decision feed's)."""
    explained: str
    decided: str
    predicted_s: float
    queue_s: float
    """The predicted time's queue part (zero where nothing was waiting ahead of it)."""
    first_token_s: float

    @property
    def error(self) -> float:
        """The prediction's error relative to the client's first token."""
        return abs(self.predicted_s - self.first_token_s) / self.first_token_s


def open_stream(url: str, body: dict[str, Any]) -> tuple[float, Any]:
    """Send a stream; its start, and its response once the headers are in (vLLM sends them as
    soon as it has the request: the router has decided by then)."""
    req = urllib.request.Request(url + CHAT, data=json.dumps(body).encode(), headers={"content-type": JSON})
    started = time.perf_counter()
    return started, urllib.request.urlopen(req, timeout=120)


def first_token(started: float, resp: Any) -> float:
    """Seconds from ``started`` to the stream's first ``data:`` line (read to its end)."""
    first = None
    with resp:
        for line in resp:
            if first is None and line.startswith(b"data:"):
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("a stream ended without a data line")
    return first


def measure(
    url: str,
    admin_address: str,
    body: Callable[[int, int], dict[str, Any]],
    *,
    clients: int,
    rounds: int,
    warm_rounds: int,
) -> tuple[list[Row], int]:
    """``clients`` clients each send ``rounds`` streams (``body(client, round)``); the rows of those
    after each client's ``warm_rounds``, in decision order, and how many decisions the feed saw."""
    with grpc.insecure_channel(admin_address) as channel:
        admin = pb_grpc.AdminStub(channel)
        decided: list[str] = []
        watch = admin.WatchDecisions(pb.WatchRequest(sample_rate=1.0))

        def follow() -> None:
            with contextlib.suppress(grpc.RpcError):
                for event in watch:
                    decided.append(event.replica)

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        time.sleep(0.5)  # real time: the feed subscribed before the first request
        raw: list[tuple[int, str, float, float, float]] = []
        order = threading.Lock()
        sent = 0
        failures: list[BaseException] = []

        def client(c: int) -> None:
            nonlocal sent
            try:
                for r in range(rounds):
                    request = body(c, r)
                    headers = [
                        pb.Header(key=":path", value=CHAT),
                        pb.Header(key="content-type", value="application/json"),
                    ]
                    with order:
                        explained = admin.Explain(pb.ExplainRequest(headers=headers, body=json.dumps(request).encode()))
                        started, resp = open_stream(url, request)
                        index, sent = sent, sent + 1
                    (chosen,) = [x for x in explained.replicas if x.replica == explained.replica]
                    queue = sum(p.seconds for p in chosen.price_parts if p.part == "queue")
                    first = first_token(started, resp)
                    if r >= warm_rounds:
                        raw.append((index, explained.replica, chosen.price_ttft_s, queue, first))
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]
        deadline = time.monotonic() + 5
        while len(decided) < sent and time.monotonic() < deadline:
            time.sleep(0.05)  # real time: the decision feed of a real processor
        watch.cancel()
    rows = [
        Row(i, explained, decided[i] if i < len(decided) else "", pred, queue, first)
        for i, explained, pred, queue, first in sorted(raw)
    ]
    return rows, len(decided)


def measure_cold_prompts(
    url: str, admin_address: str, model: str, *, clients: int, rounds: int, warm_rounds: int
) -> tuple[list[Row], int]:
    """:func:`measure` on cold prompts of 650 to 1,100 tokens (a cold TTFT well over 50 ms on the
    lab's ``small`` CPU engine), 16 tokens out, after four streams alone of growing length from
    which the router's engine rates are learnt on from their prior."""
    for i in range(4):
        warm = {"model": model, "messages": cold_prompt(i, 100 + 50 * i), "max_tokens": 4, "stream": True}
        first_token(*open_stream(url, warm))

    def body(c: int, r: int) -> dict[str, Any]:
        words = 120 + 40 * ((c + r) % 3)
        return {"model": model, "messages": cold_prompt(c, words), "max_tokens": 16, "stream": True}

    return measure(url, admin_address, body, clients=clients, rounds=rounds, warm_rounds=warm_rounds)


@dataclass(frozen=True)
class Summary:
    """A run's rows, reduced."""

    requests: int
    agreed: int
    """Rows whose Explain chose the replica the router then chose (the others are not judged)."""
    queued: int
    """Agreed rows whose prediction had a queue part."""
    median_error: float
    median_error_queued: float | None
    median_error_alone: float | None
    mean_first_token_queued_s: float | None
    mean_first_token_alone_s: float | None


def summarize(rows: list[Row]) -> Summary:
    """The median relative error over the agreed rows, and apart for those predicted with and
    without a queue ahead."""
    same = [r for r in rows if r.explained == r.decided]
    queued = [r for r in same if r.queue_s > 0.0]
    alone = [r for r in same if r.queue_s <= 0.0]

    def median(rs: list[Row]) -> float | None:
        return statistics.median(r.error for r in rs) if rs else None

    def mean_first(rs: list[Row]) -> float | None:
        return statistics.fmean(r.first_token_s for r in rs) if rs else None

    return Summary(
        requests=len(rows),
        agreed=len(same),
        queued=len(queued),
        median_error=statistics.median(r.error for r in same) if same else float("nan"),
        median_error_queued=median(queued),
        median_error_alone=median(alone),
        mean_first_token_queued_s=mean_first(queued),
        mean_first_token_alone_s=mean_first(alone),
    )


def render(rows: list[Row]) -> str:
    """The rows as a small table."""
    lines = ["(explained, decided, predicted TTFT s, its queue part s, client's first token s)"]
    lines += [f"  {r.explained} {r.decided} {r.predicted_s:.3f} {r.queue_s:.3f} {r.first_token_s:.3f}" for r in rows]
    return "\n".join(lines)
