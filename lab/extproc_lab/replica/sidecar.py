"""A fake of llm-d's routing sidecar: in front of a decode replica, it makes the prefill hop the
router asked for in ``x-prefiller-host-port``, then forwards the decode hop to its replica.

A request without the header passes through unchanged (the router kept it aggregated), and so does
every other path (``/metrics``, ``/health``, ``/v1/models``: the router scrapes the replica through
it, as the address it routes to). ``GET /sidecar`` shows its counters: the hops made, those that
failed, and the prefill replicas the header named. When the prefill hop fails (an error, no
answer within ``prefill_timeout_s``, an answer without ``kv_transfer_params``) the decode hop goes
without parameters and the decode replica computes the prompt itself. The bodies are
:mod:`extproc.request.kv_transfer`'s, as the processor would build them in the other design
(docs/disaggregation.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from typing import Any

import aiohttp
from aiohttp import web

from extproc.api import CHAT_PATH, COMPLETIONS_PATH
from extproc.api.sim import PREFILLER_HEADER, answer_params, decode_body, prefill_body

log = logging.getLogger("extproc_lab.sidecar")

# Hop-by-hop and length headers are the transport's own, on each leg.
_NOT_FORWARDED = {"host", "content-length", "transfer-encoding", "connection", PREFILLER_HEADER}


class Sidecar:
    """The sidecar of one decode replica at ``decode_url`` (``http://host:port``)."""

    def __init__(self, decode_url: str, prefill_timeout_s: float = 30.0) -> None:
        self.decode_url = decode_url.rstrip("/")
        self.prefill_timeout_s = prefill_timeout_s
        self.hops = 0
        self.failed_hops = 0
        self.prefillers: Counter[str] = Counter()
        """Each ``x-prefiller-host-port`` value received, with how many requests named it."""
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def _prefill(self, prefiller: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        """The prefill hop; the answer's ``kv_transfer_params``, or None when it failed."""
        self.hops += 1
        try:
            async with self._client().post(
                f"http://{prefiller}{path}",
                json=prefill_body(body),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.prefill_timeout_s),
            ) as response:
                raw = await response.read()
                params = answer_params(raw) if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("prefill hop to %s failed (%s): decoding without it", prefiller, exc)
            params = None
        if params is None:
            self.failed_hops += 1
        return params

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """A completion: the prefill hop if asked for, then the decode hop, streamed back."""
        raw = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        prefiller = request.headers.get(PREFILLER_HEADER)
        if prefiller:
            self.prefillers[prefiller] += 1
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            if isinstance(body, dict):
                params = await self._prefill(prefiller, request.path, body, headers)
                raw = json.dumps(decode_body(body, params)).encode()
        async with self._client().post(
            self.decode_url + request.path, data=raw, headers={**headers, "content-type": "application/json"}
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_FORWARDED},
            )
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """Any other request, to the decode replica as it came."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        data = await request.read()
        async with self._client().request(
            request.method, self.decode_url + request.path_qs, data=data or None, headers=headers
        ) as upstream:
            body = await upstream.read()
            kept = {k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_FORWARDED}
            return web.Response(status=upstream.status, body=body, headers=kept)

    async def stats(self, request: web.Request) -> web.Response:
        """``GET /sidecar``: the hops made, those that failed, the prefill replicas named."""
        return web.json_response({"hops": self.hops, "failed_hops": self.failed_hops, "prefillers": self.prefillers})

    async def close(self) -> None:
        """Close the client."""
        if self._session is not None:
            await self._session.close()
            self._session = None


def build_sidecar_app(sidecar: Sidecar) -> web.Application:
    """The sidecar's application: the completion endpoints, nothing else."""
    app = web.Application(client_max_size=32 * 1024 * 1024)
    app.router.add_post(CHAT_PATH, sidecar.handle)
    app.router.add_post(COMPLETIONS_PATH, sidecar.handle)
    app.router.add_get("/sidecar", sidecar.stats)
    app.router.add_route("*", "/{tail:.*}", sidecar.passthrough)

    async def close(app: web.Application) -> None:
        await sidecar.close()

    app.on_cleanup.append(close)
    return app


async def serve_sidecar(host: str, port: int, decode_url: str, prefill_timeout_s: float = 30.0) -> None:
    """Serve a sidecar in front of ``decode_url`` on ``host:port`` until cancelled."""
    runner = web.AppRunner(build_sidecar_app(Sidecar(decode_url, prefill_timeout_s)), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        log.info("sidecar on %s:%d in front of %s", host, port, decode_url)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
