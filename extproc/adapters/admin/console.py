"""The console: a read-only page at ``/console`` on the metrics listener.

Static files shipped in the package (``static/``: no build step) and a JSON endpoint,
``/console/data``: the fleet now, its history over the last minutes (KV usage, queue, sessions
pinned), the hit-ratio curve (estimated, reported by the replicas, what round robin would have
kept; from the same counters /metrics exports) and decisions by reason. ``/console/explain``
answers the explain form (a decision without side effects). Nothing here carries a prompt, a
session key or an API key: replicas, numbers and reasons only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

from aiohttp import web
from google.protobuf.json_format import MessageToDict
from prometheus_client import Counter

from extproc.adapters.admin.fleet import fleet
from extproc.adapters.admin.service import explanation_message
from extproc.app.router import Router

STATIC = ("index.html", "console.js", "console.css")
CONTENT_TYPES = {"html": "text/html", "js": "text/javascript", "css": "text/css"}
MAX_EXPLAIN_BYTES = 1024 * 1024


def _total(counter: Counter, by: str | None = None) -> dict[str, float]:
    """A counter's ``_total`` samples summed, per value of label ``by`` (or under "")."""
    out: dict[str, float] = {}
    for family in counter.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                key = s.labels.get(by, "") if by else ""
                out[key] = out.get(key, 0.0) + s.value
    return out


@dataclass(slots=True)
class Sample:
    """The fleet at one moment."""

    t: float
    kv: dict[str, float] = field(default_factory=dict)
    queue: dict[str, int] = field(default_factory=dict)
    sessions: dict[str, int] = field(default_factory=dict)
    estimated: float | None = None
    reported: float | None = None
    round_robin: float | None = None


class ConsoleHistory:
    """Samples of the fleet every ``interval_s``, the last ``keep`` of them."""

    def __init__(self, router: Router, interval_s: float = 2.0, keep: int = 150) -> None:
        self.router = router
        self.interval_s = interval_s
        self.samples: deque[Sample] = deque(maxlen=keep)

    def sample(self) -> Sample:
        """Take one sample now."""
        m = self.router.metrics
        rows = fleet(self.router)
        blocks = _total(m.prefix_blocks).get("", 0.0)
        matched = _total(m.prefix_blocks_matched).get("", 0.0)
        rr = _total(m.prefix_blocks_round_robin).get("", 0.0)
        hits = queries = 0.0
        for rec in self.router.replicas.records():
            if rec.metrics is not None and rec.metrics.prefix_queries:
                hits += rec.metrics.prefix_hits or 0.0
                queries += rec.metrics.prefix_queries
        s = Sample(
            t=round(self.router.world.wall(), 3),
            kv={r.name: r.kv_usage for r in rows},
            queue={r.name: r.queue for r in rows},
            sessions={r.name: r.sessions_pinned for r in rows},
            estimated=round(matched / blocks, 4) if blocks else None,
            reported=round(hits / queries, 4) if queries else None,
            round_robin=round(rr / blocks, 4) if blocks else None,
        )
        self.samples.append(s)
        return s

    async def run(self) -> None:
        """Sample forever (a background task of the metrics listener)."""
        while True:
            self.sample()
            await self.router.world.sleep(self.interval_s)

    def data(self) -> dict[str, Any]:
        """What ``/console/data`` returns."""
        m = self.router.metrics
        return {
            "time": self.router.world.wall(),
            "replicas": [asdict(r) for r in fleet(self.router)],
            "history": [asdict(s) for s in self.samples],
            "decisions": {k: int(v) for k, v in sorted(_total(m.decisions, "reason").items())},
            "interval_s": self.interval_s,
            "hot_keys": self._hot_keys(),
        }

    def _hot_keys(self) -> list[dict[str, Any]] | None:
        """The hot prefixes by fingerprint (None with hot_keys off)."""
        detector = self.router.hot_keys
        if detector is None:
            return None
        ranked = sorted(detector.hot().values(), key=lambda h: -h.rate_rps)
        return [{"key": h.label, "rate": round(h.rate_rps, 1), "replicas": h.replicas} for h in ranked]


def install(app: web.Application, router: Router, interval_s: float = 2.0) -> ConsoleHistory:
    """Add the console's routes to the metrics listener's application."""
    history = ConsoleHistory(router, interval_s)
    files = resources.files("extproc.adapters.admin") / "static"

    async def page(request: web.Request) -> web.Response:
        name = request.match_info.get("name", "index.html")
        if name not in STATIC:
            raise web.HTTPNotFound()
        body = (files / name).read_bytes()
        kind = CONTENT_TYPES[name.rpartition(".")[2]]
        return web.Response(body=body, content_type=kind, headers={"Cache-Control": "no-cache"})

    async def data(_: web.Request) -> web.Response:
        return web.json_response(history.data())

    async def explain(request: web.Request) -> web.Response:
        # Read-only (no side effects), but it carries a prompt in: bounded, and never logged.
        if request.content_length is not None and request.content_length > MAX_EXPLAIN_BYTES:
            raise web.HTTPRequestEntityTooLarge(max_size=MAX_EXPLAIN_BYTES, actual_size=request.content_length)
        try:
            form = json.loads(await request.read())
            headers = {str(k).lower(): str(v) for k, v in (form.get("headers") or {}).items()}
            body = str(form.get("body") or "").encode()
        except (ValueError, AttributeError):
            return web.json_response({"error": 'expected {"headers": {...}, "body": "..."}'}, status=400)
        headers.setdefault(":path", "/v1/chat/completions")
        explained = explanation_message(await router.explain(headers, body or None))
        return web.json_response(MessageToDict(explained, preserving_proto_field_name=True))

    async def sampler(_: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(history.run(), name="console-sampler")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.router.add_get("/console", page)
    app.router.add_get("/console/", page)
    app.router.add_get("/console/static/{name}", page)
    app.router.add_get("/console/data", data)
    app.router.add_post("/console/explain", explain)
    app.cleanup_ctx.append(sampler)
    return history
