"""The fake replica's HTTP face: vLLM's OpenAI-compatible endpoints, /metrics and maintenance.

Every response carries ``x-replica-name`` and completions carry ``system_fingerprint`` set to
the replica's name and ``usage.prompt_tokens_details.cached_tokens``, so a client can tell which
replica served it and how much of its prompt was already cached there. ``GET /trace_context``
lists the trace headers (W3C ``traceparent``, ``tracestate``) and ``x-request-id`` of the last
completions received, oldest first: the context a real engine would continue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from extproc.api import CHAT_PATH, COMPLETIONS_PATH, BodyError, PromptTokenizer, TokenizerError, parse_request_body
from extproc.api.sim import HashAlgo
from extproc_lab.replica.agent_apis import AgentApis
from extproc_lab.replica.engine import Generation, KvSource, ReplicaEngine, output_budget
from extproc_lab.replica.kv_events import TokenBlocks
from extproc_lab.replica.kv_publisher import KvEventPublisher
from extproc_lab.replica.kv_transfer import (
    FETCH_FAULTS,
    PARAMS_FIELD,
    PREFILL_FAULTS,
    PULL_PATH,
    KvConnector,
    RemoteBlocks,
    wants_prefill_only,
)
from extproc_lab.replica.lora import LoraSlots
from extproc_lab.replica.timing import get_profile

log = logging.getLogger("extproc_lab.replica")

REPLICA_HEADER = "x-replica-name"
"""Response header naming the replica that answered."""

TRACE_HEADERS = ("traceparent", "tracestate", "x-request-id")
"""What ``GET /trace_context`` keeps of each completion's request headers."""
_TRACE_CONTEXTS_KEPT = 256

# Long contexts (capacity planning with 100k-token prompts) exceed aiohttp's 1 MiB default.
_MAX_BODY_BYTES = 32 * 1024 * 1024
_SHUTDOWN_GRACE_S = 2.0


@dataclass(frozen=True, slots=True)
class _Sampling:
    """The request fields that shape the answer; all others are tolerated and ignored."""

    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    include_usage: bool


def _sampling(body: dict[str, Any]) -> _Sampling:
    """Read and check the sampling fields of a body; raises :class:`BodyError` on bad values."""
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise BodyError("max_tokens must be a positive integer")
    min_tokens = body.get("min_tokens")
    if min_tokens is None:
        min_tokens = 0
    if not _is_int(min_tokens) or min_tokens < 0:
        raise BodyError("min_tokens must be a non-negative integer")
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    return _Sampling(max_tokens, min_tokens, body.get("ignore_eos") is True, include_usage)


def _is_int(value: Any) -> bool:
    # JSON true/false arrive as bool, which is an int subclass in Python.
    return isinstance(value, int) and not isinstance(value, bool)


def _error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    """An OpenAI-style error body, shaped as vLLM sends it."""
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status
    )


def _usage(gen: Generation) -> dict[str, Any]:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _ReplicaApi:
    """Request handlers bound to one engine, replica name and served model."""

    def __init__(
        self,
        engine: ReplicaEngine,
        name: str,
        model: str,
        lora: LoraSlots | None = None,
        tokenizer: PromptTokenizer | None = None,
        publisher: KvEventPublisher | None = None,
    ) -> None:
        self.engine = engine
        self.name = name
        self.model = model
        self.lora = lora
        self.tokenizer = tokenizer
        self.publisher = publisher
        self.kv = KvConnector(engine, name)
        self.trace_contexts: deque[dict[str, str]] = deque(maxlen=_TRACE_CONTEXTS_KEPT)
        # Every request header of the last completions: what reached the replica past Envoy.
        self.received_headers: deque[dict[str, str]] = deque(maxlen=_TRACE_CONTEXTS_KEPT)

    def _token_ids(self, chat: bool, body: dict[str, Any]) -> tuple[int, ...] | None:
        """The prompt's token ids as vLLM builds them, with a tokenizer (else None: text blocks)."""
        if self.tokenizer is None:
            return None
        try:
            if chat:
                return self.tokenizer.chat_ids(body.get("messages") or [], body.get("tools")).ids
            return self.tokenizer.completion_ids(body.get("prompt")).ids
        except TokenizerError as exc:
            log.debug("not tokenized (%s): text blocks", exc)
            return None

    async def completion(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions`` and ``POST /v1/completions``, streaming or not."""
        chat = request.path == CHAT_PATH
        self.trace_contexts.append({k: v for k in TRACE_HEADERS if (v := request.headers.get(k)) is not None})
        self.received_headers.append({k.lower(): v for k, v in request.headers.items()})
        try:
            parsed = parse_request_body(request.path, await request.read())
            sampling = _sampling(parsed.body)
        except BodyError as exc:
            return _error(400, str(exc))
        # Any model name is served (a fake need not refuse), and it seeds the block hashes as
        # the router's do, so different models never share cached blocks.
        model = parsed.model or self.model
        # With LoRA on, as vLLM with --enable-lora: another name is an adapter, swapped into a
        # slot (see extproc_lab.replica.lora), or a 404 when it cannot be resolved.
        if self.lora is not None and self.lora.enabled and model != self.model and not self.lora.use(model):
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": self.name,
        }
        token_ids = self._token_ids(chat, parsed.body)
        # Another name than the served model is an adapter (vLLM with --enable-lora): its name goes
        # into every block's hash, so its blocks never match the base's or another adapter's.
        lora_name = model if model != self.model else None
        salt = parsed.body.get("cache_salt")
        cache_salt = salt if isinstance(salt, str) and salt else None
        # Disaggregated serving (see extproc_lab.replica.kv_transfer): a prefill hop answers with
        # where its blocks wait; a decode hop first pulls them.
        params = parsed.body.get(PARAMS_FIELD)
        prefill_only = wants_prefill_only(params)
        remote = RemoteBlocks.parse(params)
        kv_source = self.kv.source(remote) if remote is not None else None
        if prefill_only:
            if self.kv.faults.prefill == "fail":
                return _error(500, "prefill failed (injected fault)", "InternalServerError")
            if self.kv.faults.prefill == "hang":
                await asyncio.Event().wait()  # until the client gives up
            self._advertise(request)
        if parsed.stream and not prefill_only:
            return await self._stream(
                request,
                parsed.prompt,
                model,
                sampling=sampling,
                head=head,
                chat=chat,
                token_ids=token_ids,
                lora_name=lora_name,
                cache_salt=cache_salt,
                kv_source=kv_source,
            )
        gen = await self.engine.generate(
            parsed.prompt,
            model,
            max_tokens=sampling.max_tokens,
            min_tokens=sampling.min_tokens,
            ignore_eos=sampling.ignore_eos,
            token_ids=token_ids,
            lora_name=lora_name,
            cache_salt=cache_salt,
            kv_source=kv_source,
        )
        choice: dict[str, Any] = {"index": 0, "finish_reason": gen.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": gen.text}
        else:
            choice["text"] = gen.text
        obj = "chat.completion" if chat else "text_completion"
        answer = {**head, "object": obj, "choices": [choice], "usage": _usage(gen)}
        if prefill_only:
            answer[PARAMS_FIELD] = self.kv.export(gen.block_keys)
        return web.json_response(answer)

    def _advertise(self, request: web.Request) -> None:
        """The address a decode replica pulls blocks from: the socket this request came in on."""
        if self.kv.port == 0 and request.transport is not None:
            host, port = request.transport.get_extra_info("sockname")[:2]
            self.kv.host, self.kv.port = str(host), int(port)

    async def _stream(
        self,
        request: web.Request,
        prompt: str,
        model: str,
        *,
        sampling: _Sampling,
        head: dict[str, Any],
        chat: bool,
        token_ids: tuple[int, ...] | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        kv_source: KvSource | None = None,
    ) -> web.StreamResponse:
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})

        def chunk(delta: dict[str, str] | str, finish_reason: str | None = None) -> bytes:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
            choice["delta" if chat else "text"] = delta
            return _sse({**head, "choices": [choice]})

        # The engine decides the answer's length as it admits it; the same budget tells which token
        # is the last, whose chunk carries the finish reason, as vLLM's does.
        count, reason = output_budget(
            self.engine.profile.default_output_tokens, sampling.max_tokens, sampling.min_tokens, sampling.ignore_eos
        )

        async def on_token(index: int, text: str) -> None:
            if index == 0 and chat:
                # As vLLM's chat server: the role-only chunk goes out with the first output.
                await response.write(chunk({"role": "assistant", "content": ""}))
            finish = reason if index == count - 1 else None
            await response.write(chunk({"content": text} if chat else text, finish))

        try:
            # As vLLM's OpenAI server (a Starlette StreamingResponse): the headers leave before the
            # engine has produced anything, so a proxy timing them sees the request's arrival,
            # never its time to first token (queueing and prefill come after them).
            await response.prepare(request)
            gen = await self.engine.generate(
                prompt,
                model,
                max_tokens=sampling.max_tokens,
                min_tokens=sampling.min_tokens,
                ignore_eos=sampling.ignore_eos,
                on_token=on_token,
                token_ids=token_ids,
                lora_name=lora_name,
                cache_salt=cache_salt,
                kv_source=kv_source,
            )
            if gen.completion_tokens != count:  # not expected: the budget above is the engine's
                await response.write(chunk({} if chat else "", gen.finish_reason))
            if sampling.include_usage:
                await response.write(_sse({**head, "choices": [], "usage": _usage(gen)}))
            await response.write(_sse("[DONE]"))
            await response.write_eof()
        except ConnectionResetError:
            # The client went away; the engine has counted the request as aborted.
            log.debug("client closed a stream on %s", self.name)
        return response

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the one served model."""
        card = {
            "id": self.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
        }
        adapters = sorted(self.lora.known) if self.lora is not None else []
        cards = [card, *({**card, "id": a, "root": a, "parent": self.model} for a in adapters)]
        return web.json_response({"object": "list", "data": cards})

    async def health(self, request: web.Request) -> web.Response:
        """``GET /health``: 200 while the server runs, as vLLM's."""
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        """``GET /metrics``: vLLM's metric names, for the router's scraper."""
        page = self.engine.metrics_text(self.model)
        if self.lora is not None:
            page += self.lora.exposition().encode()
        return web.Response(body=page, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def trace_context(self, request: web.Request) -> web.Response:
        """``GET /trace_context``: the trace headers of the last completions received, oldest first."""
        return web.json_response(list(self.trace_contexts))

    async def received(self, request: web.Request) -> web.Response:
        """``GET /received_headers`` (fake replica only): every request header of the last
        completions received (names lowercased), oldest first."""
        return web.json_response(list(self.received_headers))

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """``POST /reset_prefix_cache``: drop every cached block, as vLLM's endpoint does."""
        self.engine.reset_prefix_cache()
        log.info("prefix cache of %s reset", self.name)
        return web.Response(status=200)

    async def drop_kv_events(self, request: web.Request) -> web.Response:
        """``POST /kv_events/drop?n=N`` (fake replica only): the next N event batches are buffered
        for replay but not sent, as if lost on the way."""
        if self.publisher is None:
            return _error(404, "this replica publishes no KV events", "NotFoundError")
        self.publisher.drop_next += max(0, int(request.query.get("n", "1")))
        return web.Response(status=200)

    async def kv_pull(self, request: web.Request) -> web.Response:
        """``POST /kv_transfer/pull`` (the connector's side channel): how many of the leading
        ``block_ids`` this replica still holds for ``engine_id``."""
        try:
            body = await request.json()
            ids = [int(i) for i in body["block_ids"]]
            engine_id = str(body["engine_id"])
        except (ValueError, KeyError, TypeError):
            return _error(400, "expected engine_id and block_ids")
        return web.json_response({"blocks": self.kv.still_held(engine_id, ids)})

    async def kv_faults(self, request: web.Request) -> web.Response:
        """``POST /kv_transfer/faults`` (fake replica only): ``{"prefill": "ok"|"fail"|"hang",
        "fetch": "ok"|"fail"}``, either or both."""
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "expected a JSON object")
        faults = self.kv.faults
        prefill = body.get("prefill", faults.prefill)
        fetch = body.get("fetch", faults.fetch)
        if prefill not in PREFILL_FAULTS or fetch not in FETCH_FAULTS:
            return _error(400, f"prefill is one of {PREFILL_FAULTS}, fetch one of {FETCH_FAULTS}")
        faults.prefill, faults.fetch = prefill, fetch
        return web.json_response({"prefill": prefill, "fetch": fetch})

    async def kv_transfer_state(self, request: web.Request) -> web.Response:
        """``GET /kv_transfer`` (fake replica only): the connector's counters and faults."""
        kv = self.kv
        return web.json_response(
            {
                "engine_id": kv.engine_id,
                "exported_blocks": kv.exported_blocks,
                "fetched_blocks": kv.fetched_blocks,
                "failed_fetches": kv.failed_fetches,
                "faults": {"prefill": kv.faults.prefill, "fetch": kv.faults.fetch},
            }
        )

    async def kv_events_state(self, request: web.Request) -> web.Response:
        """``GET /kv_events`` (fake replica only): the next sequence number and what the replay buffer holds."""
        if self.publisher is None:
            return _error(404, "this replica publishes no KV events", "NotFoundError")
        return web.json_response({"next_seq": self.publisher.seq, "buffered": len(self.publisher.buffer)})


def build_app(
    engine: ReplicaEngine,
    name: str,
    model: str,
    lora: LoraSlots | None = None,
    tokenizer: PromptTokenizer | None = None,
    publisher: KvEventPublisher | None = None,
) -> web.Application:
    """The aiohttp application of one fake replica called ``name`` serving ``model`` (and, with
    ``lora``, its LoRA adapters; with ``tokenizer``, prompts in tokens; with ``publisher``, KV
    events)."""
    api = _ReplicaApi(engine, name, model, lora, tokenizer, publisher)
    app = web.Application(client_max_size=_MAX_BODY_BYTES)

    async def stamp(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[REPLICA_HEADER] = name

    # A prepare hook rather than a middleware: it also stamps aiohttp's own 404/405 answers.
    app.on_response_prepare.append(stamp)
    app.router.add_post(CHAT_PATH, api.completion)
    app.router.add_post(COMPLETIONS_PATH, api.completion)
    AgentApis(api).register(app)  # /v1/messages and /v1/responses, as vLLM serves them
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.metrics)
    app.router.add_get("/trace_context", api.trace_context)
    app.router.add_get("/received_headers", api.received)
    app.router.add_post("/reset_prefix_cache", api.reset_prefix_cache)
    app.router.add_post("/kv_events/drop", api.drop_kv_events)
    app.router.add_get("/kv_events", api.kv_events_state)
    app.router.add_post(PULL_PATH, api.kv_pull)
    app.router.add_post("/kv_transfer/faults", api.kv_faults)
    app.router.add_get("/kv_transfer", api.kv_transfer_state)

    async def close_connector(app: web.Application) -> None:
        await api.kv.close()

    app.on_cleanup.append(close_connector)
    return app


# Positional parameters kept as published: callers (the CLI, the demo) may pass them in order.
async def serve_replica(
    name: str,
    host: str,
    port: int,
    profile_name: str = "demo",
    model: str = "demo-model",
    time_scale: float | None = None,
    ready: asyncio.Future[int] | None = None,
    *,
    lora_adapters: Sequence[str] = (),
    max_lora: int | None = None,
    lora_on_demand: bool = True,
    tokenizer_dir: str | None = None,
    kv_events: str | None = None,
    kv_replay: str | None = None,
    kv_events_encoding: str = "map",
    hash_algo: str = "sha256",
    kv_blocks: int | None = None,
    kv_transfer_s_per_block: float | None = None,
    cpu_offload_blocks: int = 0,
) -> None:
    """Serve one fake replica on ``host:port`` until cancelled, then shut the server down cleanly.

    ``profile_name`` picks a :data:`~extproc_lab.replica.timing.PROFILES` entry, ``time_scale``
    overrides its speed. ``ready``, when given, receives the bound port once the replica accepts
    connections (useful with ``port=0``), or the error if it could not start.

    ``lora_adapters`` are loaded at start into ``max_lora`` slots (default: one per adapter, and
    LoRA off without adapters); ``lora_on_demand`` loads other adapter names on their first
    request, else they are a 404 (:mod:`extproc_lab.replica.lora`).

    With ``tokenizer_dir`` prompts are tokenized as vLLM does and the cache is keyed by vLLM's
    block hashes (``hash_algo``, PYTHONHASHSEED honoured); with ``kv_events`` every store,
    eviction and reset is published there (topic ``kv@<name>@<model>``), ``kv_replay`` answering
    replays. ``kv_blocks`` overrides the profile's ``num_gpu_blocks`` (a smaller cache: pressure),
    ``kv_transfer_s_per_block`` its time to pull a block in a disaggregated decode hop.
    ``cpu_offload_blocks`` puts that many blocks of CPU memory behind the cache, as vLLM's
    offloading connector (:mod:`extproc_lab.replica.offload`), its events with ``medium: "CPU"``.
    """
    publisher = None
    try:
        profile = get_profile(profile_name, time_scale)
        if kv_blocks is not None:
            profile = dataclasses.replace(profile, num_gpu_blocks=kv_blocks)
        if kv_transfer_s_per_block is not None:
            profile = dataclasses.replace(profile, kv_transfer_s_per_block=kv_transfer_s_per_block)
        if cpu_offload_blocks:
            profile = dataclasses.replace(profile, cpu_offload_blocks=cpu_offload_blocks)
        tokenizer = PromptTokenizer(tokenizer_dir) if tokenizer_dir else None
        blocks = TokenBlocks(profile.block_size, HashAlgo(hash_algo)) if tokenizer is not None else None
        if kv_events:
            publisher = KvEventPublisher(kv_events, kv_replay, f"kv@{name}@{model}", kv_events_encoding)
            publisher.start()
        engine = ReplicaEngine(profile, token_blocks=blocks, publish=publisher.publish if publisher else None)
        slots = len(lora_adapters) if max_lora is None else max_lora
        lora = LoraSlots(slots, lora_adapters, on_demand=lora_on_demand) if slots or lora_adapters else None
        app = build_app(engine, name, model, lora, tokenizer, publisher)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=_SHUTDOWN_GRACE_S)
        await runner.setup()
    except BaseException as exc:
        if publisher is not None:
            await publisher.close()
        _fail(ready, exc)
        raise
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = int(runner.addresses[0][1])
        log.info("replica %s (%s, profile %s) listening on %s:%d", name, model, engine.profile.name, host, bound)
        if ready is not None and not ready.done():
            ready.set_result(bound)
        await asyncio.Event().wait()
    except BaseException as exc:
        _fail(ready, exc)
        raise
    finally:
        await runner.cleanup()
        if publisher is not None:
            await publisher.close()


def _fail(ready: asyncio.Future[int] | None, exc: BaseException) -> None:
    """Tell a waiter the replica will not become ready."""
    if ready is None or ready.done():
        return
    if isinstance(exc, asyncio.CancelledError):
        ready.cancel()
    else:
        ready.set_exception(exc)
